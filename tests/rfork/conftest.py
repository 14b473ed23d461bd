"""Fixtures for rfork's end-to-end tests: a real planner, small checkpoints, seed processes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("RFORK_TCP_HOST", "127.0.0.1")  # keep tcp on loopback (children inherit it)

from bench.processes import Child, Fleet, seed_args  # noqa: E402
from rfork import LoadOptions, SourceIdentity  # noqa: E402
from rfork.identity import fingerprint  # noqa: E402
from rfork.seed.seed import Seed  # noqa: E402
from rfork.weights.checkpoint import read_checkpoint_info
from rfork.weights.rank_weights import RankWeights  # noqa: E402
from rfork.weights.synthetic import LlamaConfig, write_synthetic_checkpoint  # noqa: E402
from tests.tiny_llama import SMALL as SMALL_SHAPE  # noqa: E402
from tests.tiny_llama import LlamaForCausalLM  # noqa: E402

SMALL = LlamaConfig(**SMALL_SHAPE)  # ~8.6 MB in bf16


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(
        tmp_path_factory.mktemp("ckpt-small"), config=SMALL, shard_bytes=3 << 20
    )


@pytest.fixture(scope="session")
def medium_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~60 MB: long enough on the wire to kill a seed in the middle of it."""
    cfg = LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=8192,
    )
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("ckpt-medium"), config=cfg)


# The end-to-end tests run with auth on, each process with the least privilege it needs: seeds
# register; loaders request assignments and report (load) and register to become seeds.
ADMIN, REGISTER, LOAD, READER = "e2e-admin", "e2e-register", "e2e-load", "e2e-reader"
AUTH: dict[str, Any] = {"token": LOAD, "register_token": REGISTER}  # a loader's credentials


@pytest.fixture
def planner(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A planner with auth on; child processes get RFORK_TOKEN (load) and RFORK_REGISTER_TOKEN."""
    from planner import PlannerServer

    monkeypatch.setenv("RFORK_TOKEN", LOAD)
    monkeypatch.setenv("RFORK_REGISTER_TOKEN", REGISTER)
    with PlannerServer(
        db_url=sqlite_url,
        admin_token=ADMIN,
        register_token=REGISTER,
        anchor_token=REGISTER,  # one string, both roles: the tests' disk seeds anchor their identity
        load_token=LOAD,
        reader_token=READER,
    ) as srv:
        yield srv.url


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path / "procs")
    try:
        yield f
    finally:
        f.close()


def identity_of(ckpt: Path, tp: int = 1):
    return read_checkpoint_info(ckpt).identity(tp=tp)


def start_seed(
    fleet,
    ckpt: Path,
    planner_url: str,
    name: str = "seed",
    tp: int = 1,
    *,
    providers: Sequence[str] = ("tcp",),
    env: dict[str, str] | None = None,
    extra: Sequence[str] = (),
) -> tuple[list[str], Child]:
    ready = fleet.workdir / f"{name}.ready.json"
    args = seed_args(ckpt, planner_url, ready, tp=tp, providers=providers, extra=extra)
    child = fleet.spawn(name, args, env=env)
    info = fleet.wait_file(child, ready, timeout_s=90)
    return info["instance_ids"], child


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def opts(**kw: Any) -> LoadOptions:
    """LoadOptions for a test: tcp, a 3 s dead-peer bound, a 60 s rank deadline."""
    return LoadOptions(providers=["tcp"], transfer_timeout_s=3.0, rank_deadline_s=60.0, **kw)


def tied_model(seed: int) -> LlamaForCausalLM:
    """The small Llama with lm_head tied to the embedding and a zero-byte buffer (edge cases in place)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(SMALL)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: one storage, two names
    model.register_buffer("empty_buf", torch.empty(0, 8))
    return model


@contextlib.contextmanager
def tied_seed(planner_url: str) -> Iterator[tuple[LlamaForCausalLM, SourceIdentity, Seed]]:
    """An in-process seed serving tied_model(0): (the model, its identity, the seed)."""
    model = tied_model(0)
    ident = identity_for(model)
    with Seed(
        weights=[RankWeights.from_tensors(tensors=model.state_dict())],
        identity=ident,
        planner_url=planner_url,
        token=REGISTER,
    ) as seed:
        yield model, ident, seed


def identity_for(model: torch.nn.Module) -> SourceIdentity:
    """An identity whose fingerprint is the model's own state dict."""
    return SourceIdentity(
        model="in-place-test",
        revision="r1",
        dtype="bfloat16",
        fingerprint=fingerprint((n, str(t.dtype), t.shape) for n, t in model.state_dict().items()),
    )
