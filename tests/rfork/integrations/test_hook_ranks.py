"""The hook template's rank code in one process per rank, at TP=2 x PP=2, for the parallel layouts
an engine's CPU build cannot run here (SGLang's TP=2, vLLM's PP=2): each worker of a seeding instance
publishes its own rank (global rank pp_rank * tp + tp_rank) under its own shard's parameters
identity, and each worker of the next instance pulls exactly its rank's shard straight into its
parameters, 1.00x its size.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rfork.integrations.hook.loader_base import Parallel, RforkLoaderBase

pytestmark = pytest.mark.slow

MODEL_CONFIG = SimpleNamespace(
    model_path="/models/ranks", hf_config=None, revision=None, dtype=torch.bfloat16, quantization=None
)
LAYERS, HIDDEN = 4, 64


class _Base:
    """Stands for a framework's BaseModelLoader: it keeps the load config."""

    def __init__(self, load_config: Any) -> None:
        self.load_config = load_config


class _RankLoader(RforkLoaderBase, _Base):
    """A framework worker at one position of a TP x PP layout (the engine's parallel state)."""

    framework = "toy"
    framework_name = "Toy"
    pulls_after_post_load = True

    def __init__(self, planner_url: str, par: Parallel) -> None:
        extra = {"planner_url": planner_url, "mode": "parameters", "transfer_timeout_s": 3.0}
        super().__init__(SimpleNamespace(model_loader_extra_config=extra))
        self.par = par

    def parallel(self) -> Parallel:
        return self.par

    def framework_version(self) -> str:
        return "1"

    def model_path(self, model_config: Any) -> str:
        return str(model_config.model_path)

    def arrange_drain(self, seed: Any) -> None:
        """The test closes the seed itself."""


def _shard(par: Parallel, *, filled: bool) -> torch.nn.Module:
    """This rank's part of a toy model: PP stage p holds its layers, TP rank t its rows of each."""
    module = torch.nn.Module()
    gen = torch.Generator().manual_seed(1000 * par.pp_rank + par.tp_rank)
    per_stage = LAYERS // par.pp
    for layer in range(par.pp_rank * per_stage, (par.pp_rank + 1) * per_stage):
        rows = torch.randn(HIDDEN // par.tp, HIDDEN, generator=gen).to(torch.bfloat16)
        data = rows if filled else torch.zeros_like(rows)
        module.register_parameter(f"layer{layer}_proj", torch.nn.Parameter(data, requires_grad=False))
    return module


def _seed_rank(url: str, par: Parallel, out: Any, stop: Any) -> None:
    """A seeding instance's worker: no seed yet, so the engine's disk load (the filled shard), then
    it serves its rank."""
    hook = _RankLoader(url, par)
    model = _shard(par, filled=True)
    hook.fell_back(model, MODEL_CONFIG, reason="no seed yet", seconds=0.0)
    seed = hook.become_seed(model)
    out.put(("seeded", hook.global_rank(), seed is not None))
    stop.wait(120)
    if seed is not None:
        seed.close()


def _pull_rank(url: str, par: Parallel, out: Any) -> None:
    """The next instance's worker: pull this rank into its empty parameters."""
    hook = _RankLoader(url, par)
    model = _shard(par, filled=False)
    params = dict(model.named_parameters())
    rank = hook.global_rank()
    ident = hook.parameters_identity(MODEL_CONFIG, params, torch.device("cpu"))
    reason = hook.pull_parameters(params, identity=ident, rank=rank)
    assert hook.outcome is not None or reason is not None
    hook.note_shard(params)
    expected = dict(_shard(par, filled=True).named_parameters())
    equal = all(torch.equal(params[n].detach(), expected[n].detach()) for n in expected)
    moved = hook.outcome.moved(rank) if hook.outcome is not None else ""
    out.put(("pulled", rank, reason, equal, moved, hook.outcome.bytes if hook.outcome else 0))
    hook.release()


@pytest.fixture
def open_planner(sqlite_url: str) -> Iterator[str]:
    from planner.server import PlannerServer  # here: each spawned worker imports this module

    with PlannerServer(db_url=sqlite_url, insecure=True) as srv:
        yield srv.url


def test_each_worker_seeds_its_rank_and_the_next_instance_pulls_exactly_its_shard(open_planner):
    """TP=2 x PP=2: TP ranks share a fingerprint (same names and shapes, other bytes), PP stages do not
    (other layers); every global rank finds its own seed."""
    tp, pp = 2, 2
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    layout = [Parallel(tp=tp, pp=pp, tp_rank=t, pp_rank=p) for p in range(pp) for t in range(tp)]
    seeders = [ctx.Process(target=_seed_rank, args=(open_planner, par, out, stop)) for par in layout]
    for proc in seeders:
        proc.start()
    try:
        seeded = sorted(out.get(timeout=120) for _ in seeders)
        assert seeded == [("seeded", r, True) for r in range(tp * pp)]
        pullers = [ctx.Process(target=_pull_rank, args=(open_planner, par, out)) for par in layout]
        for proc in pullers:
            proc.start()
        pulled = sorted(out.get(timeout=120) for _ in pullers)
        for proc in pullers:
            proc.join(timeout=30)
    finally:
        stop.set()
        for proc in seeders:
            proc.join(timeout=30)
    shard = (LAYERS // pp) * (HIDDEN // tp) * HIDDEN * 2  # bf16
    for rank, (kind, got_rank, reason, equal, moved, nbytes) in enumerate(pulled):
        assert (kind, got_rank, reason, equal) == ("pulled", rank, None, True)
        assert nbytes == shard  # the planner offered this rank's seed: its shard, nothing more
        assert moved == f"rank {rank}, {shard} bytes from rfork-tcp for a {shard}-byte shard (1.00x)"
