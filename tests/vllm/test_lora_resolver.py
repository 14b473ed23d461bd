"""rfork's vLLM LoRA resolver without a server: what it hands vLLM, where it looks, what it refuses.

A real planner and a real rfork seed of an adapter (in this process); the resolver is called as vLLM
calls it (`resolve_lora`), so these need vLLM's package (.venv-vllm) but no engine.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from planner import PlannerServer
from rfork.integrations.hook.settings import HookSettings
from rfork.integrations.vllm.lora_resolver import RforkLoraResolver
from rfork.seed.seed import Seed
from rfork.weights.adapters import adapter_identity, read_adapter
from rfork.weights.rank_weights import RankWeights
from rfork.weights.synthetic import write_synthetic_lora
from tests.vllm.servers import TINY

pytestmark = [pytest.mark.vllm]

BASE = "/models/tiny"


def _resolver(planner_url: str | None, storage: Path | None, cache: Path) -> RforkLoraResolver:
    settings = HookSettings(planner_url=planner_url, transfer_timeout_s=3.0)
    return RforkLoraResolver(settings, storage, cache)


def _same_adapter(a: Path, b: Path) -> None:
    """The same config bytes and the same tensors (the safetensors files may order them differently)."""
    assert (a / "adapter_config.json").read_bytes() == (b / "adapter_config.json").read_bytes()
    ta, tb = read_adapter(a), read_adapter(b)
    assert ta.keys() == tb.keys()
    for n, t in ta.items():
        assert torch.equal(t, tb[n]), n


def test_a_peers_adapter_is_pulled_verified_and_handed_to_vllm_as_a_directory(tmp_path, sqlite_url):
    src = write_synthetic_lora(tmp_path / "src" / "ad1", config=TINY, base_model=BASE, seed=3)
    with PlannerServer(db_url=sqlite_url, insecure=True) as planner:
        weights = RankWeights.from_state_dict(read_adapter(src))
        identity = adapter_identity(base=BASE, name="ad1")
        with Seed(weights=[weights], identity=identity, planner_url=planner.url):
            resolver = _resolver(planner.url, None, tmp_path / "cache")
            try:
                request = asyncio.run(resolver.resolve_lora(BASE, "ad1"))
                assert request is not None
                assert request.lora_name == "ad1"
                pulled = Path(request.lora_path)
                assert pulled.parent == tmp_path / "cache"
                _same_adapter(src, pulled)
                assert json.loads((pulled / "adapter_config.json").read_text())["peft_type"] == "LORA"
                # the same name again: the same directory, nothing pulled twice
                assert resolver.fetch(BASE, "ad1") == pulled
                # another base model is another identity: nobody serves it
                assert asyncio.run(resolver.resolve_lora("/models/other", "ad1")) is None
            finally:
                resolver.close()


def test_without_a_reachable_planner_it_reads_storage_and_refuses_unsafe_names(tmp_path):
    storage = tmp_path / "adapters"
    write_synthetic_lora(storage / "ad2", config=TINY, base_model=BASE, seed=4)
    (tmp_path / "outside").mkdir()
    resolver = _resolver("http://127.0.0.1:9", storage, tmp_path / "cache")  # nothing listens on port 9
    try:
        request = asyncio.run(resolver.resolve_lora(BASE, "ad2"))
        assert request is not None
        assert Path(request.lora_path) == storage / "ad2"  # vLLM reads the files where they are
        assert asyncio.run(resolver.resolve_lora(BASE, "missing")) is None
        for bad in ("..", "../outside", "ad2/../../outside", ".ad2"):
            assert asyncio.run(resolver.resolve_lora(BASE, bad)) is None
    finally:
        resolver.close()
