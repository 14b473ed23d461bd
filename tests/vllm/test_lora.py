"""LoRA adapters peer to peer between real vLLM servers on CPU (`--enable-lora`, rfork's LoRA resolver).

A reads adapters from its storage directory (RFORK_LORA_DIR) the first time a request names them and
serves them as seeds; B, whose storage is empty, gets each adapter from A through the planner, verified,
and serves it too. The tokens of every adapter are equal on both servers and differ from the base
model's; an adapter nobody holds, and a name that is not a safe directory name, are a 404.
"""

from __future__ import annotations

import time
import urllib.error
from pathlib import Path
from typing import Any

import pytest

from rfork.weights.synthetic import write_synthetic_lora
from tests.integrations.server_flow import Planner, instances
from tests.vllm.servers import TINY, ServerFleet, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
PROMPT = [11, 12, 13, 14, 15, 16]


def complete(server: VllmServer, model: str) -> list[int]:
    """Greedy tokens for PROMPT from `model` (the base's served name or an adapter's)."""
    return server.generate(PROMPT, 8, model=model)


def status_of(server: VllmServer, model: str) -> int:
    try:
        complete(server, model)
    except urllib.error.HTTPError as exc:
        return exc.code
    return 200


def adapter_seeds(planner: Planner, name: str) -> list[dict[str, Any]]:
    ready = instances(planner, status="READY")
    return [i for i in ready if i["identity"]["model"] == name and i["identity"]["framework"] == "peft-lora"]


def wait_for_seeds(planner: Planner, name: str, count: int, timeout_s: float = 30.0) -> None:
    """Until `count` servers serve adapter `name` (a server publishes an adapter after vLLM loaded it)."""
    deadline = time.monotonic() + timeout_s
    while len(adapter_seeds(planner, name)) != count:
        assert time.monotonic() < deadline, f"{name}: {len(adapter_seeds(planner, name))} seeds, not {count}"
        time.sleep(0.1)


def test_adapters_move_between_servers_through_the_planner(
    planner: Planner, tiny_model: Path, tmp_path: Path
) -> None:
    storage, empty = tmp_path / "adapters", tmp_path / "empty"
    empty.mkdir()
    for seed, name in ((1, "ad1"), (2, "ad2")):
        write_synthetic_lora(storage / name, config=TINY, base_model=str(tiny_model), seed=seed)
    (tmp_path / "servers").mkdir()
    fleet = ServerFleet(tmp_path / "servers", tiny_model, server_args=LORA_ARGS)
    base_env = {
        **fleet.env,
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        "RFORK_PLANNER_URL": planner.url,
        "RFORK_MODEL_NAME": "tiny-llama",
        "RFORK_TRANSFER_TIMEOUT_S": "3",
    }
    try:
        fleet.env = {**base_env, "RFORK_LORA_DIR": str(storage)}
        a = fleet.start_auto("lora-A")
        fleet.env = {**base_env, "RFORK_LORA_DIR": str(empty)}
        b = fleet.start_auto("lora-B")
        a.wait_ready()
        b.wait_ready()
        base = complete(a, "tiny")
        assert status_of(b, "ad2") == 404  # nobody holds it yet, and B's storage is empty
        for name in ("ad1", "ad2"):
            from_storage = complete(a, name)
            assert from_storage != base  # the adapter is applied
            assert len(adapter_seeds(planner, name)) == 1  # A serves what it read
            assert complete(b, name) == from_storage
            wait_for_seeds(planner, name, 2)  # and now B too
        assert "from a peer" in b.log()
        assert "verified" in b.log()
        assert status_of(a, "ad1") == 200  # resolved once, then vLLM's own
        assert status_of(b, "..") == 404
        assert status_of(b, "no-such-adapter") == 404
    finally:
        fleet.close()
    assert not adapter_seeds(planner, "ad1")  # both drained at shutdown
