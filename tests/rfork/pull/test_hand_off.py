"""One hand-off: the seed a load becomes adopts the pull's engine and registrations, so every buffer is
registered once per process (on a real NIC registration is the expensive step), through `rfork load`
and through a framework hook that becomes a seed later; what no seed adopts is closed.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

import pytest
import torch

from backends import Region, TransferEngine
from rfork import pull_into
from rfork.cli import load as load_command
from rfork.seed.seed import Seed
from rfork.weights.rank_weights import RankWeights
from tests.rfork.conftest import AUTH, REGISTER, assert_same, opts, start_seed, tied_model, tied_seed


def spy_registrations(monkeypatch: pytest.MonkeyPatch) -> list[Region]:
    """Every region `TransferEngine.register` makes in this process from now on."""
    made: list[Region] = []
    register = TransferEngine.register

    def spy(engine: TransferEngine, obj: Any, access: str = "rw") -> Region:
        region = register(engine, obj, access)
        made.append(region)
        return region

    monkeypatch.setattr(TransferEngine, "register", spy)
    return made


def assert_registered_once(made: list[Region], weights: RankWeights) -> None:
    """Each of the weights' regions registered exactly once, and nothing else."""
    times = Counter((r.ptr, r.nbytes) for r in made)
    assert sorted(times) == sorted((a.ptr, a.nbytes) for a in weights.ranges)
    assert set(times.values()) == {1}, times


@pytest.mark.slow
def test_a_pull_that_becomes_a_seed_later_registers_each_buffer_once(planner, monkeypatch):
    """The hooks' order: pull, then the framework's post-load steps, then become a seed."""
    with tied_seed(planner) as (model, ident, seed):
        made = spy_registrations(monkeypatch)
        target = tied_model(1)
        result = pull_into(
            identity=ident,
            planner_url=planner,
            tensors=target.state_dict(),
            options=opts(become_seed=False, seed_later=True),
            **AUTH,
        )
        try:
            assert result.source == "rfork-tcp"
            assert result.seed is None  # nothing published yet: the framework still runs its steps
            later = Seed.adopt(result, planner_url=planner, token=REGISTER, providers=["tcp"])
            assert_registered_once(made, result.weights[0])
            assert result.client is not None  # one planner connection pool per process
            assert later.publications[0].client._http is result.client._http
            third = pull_into(
                identity=ident,
                planner_url=planner,
                tensors={n: torch.empty_like(t) for n, t in model.state_dict().items()},
                options=opts(exclude=seed.instance_ids, become_seed=False),
                **AUTH,
            )
            assert third.attempts[0].instance_id == later.instance_ids[0]  # served by what it adopted
            assert_same(third.state_dict(), model.state_dict())
        finally:
            result.close()


@pytest.mark.slow
def test_rfork_load_registers_each_buffer_once(planner, fleet, small_ckpt, monkeypatch):
    start_seed(fleet, small_ckpt, planner)  # a seed process: its registrations are not counted here
    made = spy_registrations(monkeypatch)
    served: list[Any] = []

    def report_and_serve(_args: Any, result: Any, *_: Any) -> None:
        served.append(result)
        assert result.seed is not None
        assert_registered_once(made, result.weights[0])

    monkeypatch.setattr(load_command, "_report_and_serve", report_and_serve)
    parser = argparse.ArgumentParser()
    load_command.configure(parser)
    args = parser.parse_args(["--checkpoint", str(small_ckpt), "--planner", planner, "--no-progress"])
    assert load_command.run(args) == 0
    assert served[0].source == "rfork-tcp"
    assert served[0].seed is None  # drained on the way out


@pytest.mark.slow
def test_a_pull_no_seed_adopts_is_closed(planner):
    with tied_seed(planner) as (_model, ident, _seed):
        result = pull_into(
            identity=ident,
            planner_url=planner,
            tensors=tied_model(1).state_dict(),
            options=opts(become_seed=False, seed_later=True),
            **AUTH,
        )
        engine, regions = result.engine, result.ranks[0].regions
        assert engine is not None
        assert regions
        assert not engine.closed  # held for a seed
        result.close()  # the framework never became one
        assert engine.closed
        assert all(r.closed for r in regions)
        assert result.engine is None
