"""Expert-parallel dispatch/combine (backends.moe) over real engines: exact against the reference.

Two layers (the routing-plan math alone is in test_routing.py): the real transport with P engines
in this process (hypothesis over T, k, P, hidden), and 4 spawned ranks on tcp and shm. Plus
misuse, bad input, a stalled peer and a SIGKILLed rank.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends import TransferEngine, provider_available
from backends.moe import ExpertParallel, MoEError, MoETimeout
from tests.backends.conftest import skip_unless_pairs_within_process
from tests.backends.moe.cases import Case, apply_expert, expert_tables, rank_inputs, reference
from tests.backends.moe.test_routing import moe_cases
from tests.backends.moe.worker import run_rank
from tests.backends.processes import CTX

PROVIDERS = [p.strip() for p in os.environ.get("RFORK_TEST_PROVIDERS", "tcp,shm").split(",") if p.strip()]
_groups = itertools.count()  # a fresh group (channel) name per group: nothing left over between examples


def _skip_unless(provider: str) -> None:
    if provider not in ("tcp", "shm"):
        pytest.skip(f"{provider} is not exercised by the MoE tests")
    if not provider_available(provider, "127.0.0.1" if provider == "tcp" else None):
        pytest.skip(f"provider {provider} is not available on this machine")


# ----- 2. the real transport, P engines in this process -------------------------------------------
@pytest.fixture(scope="module", params=PROVIDERS)
def engines(request: pytest.FixtureRequest) -> Iterator[list[TransferEngine]]:
    provider = str(request.param)
    _skip_unless(provider)
    skip_unless_pairs_within_process(provider)
    kw: dict[str, Any] = {"host": "127.0.0.1"} if provider == "tcp" else {}
    engs = [
        TransferEngine(provider, 1, timeout_s=5.0, chunk_bytes=64 << 20, reorder_for_test=True, **kw)
        for _ in range(5)
    ]
    yield engs
    for e in engs:
        e.close()


def _group(engs: list[TransferEngine], case: Case, **kw: Any) -> list[ExpertParallel]:
    group = f"g{next(_groups)}"
    eps = [
        ExpertParallel(
            engs[r],
            rank=r,
            world_size=case.world,
            num_experts=case.num_experts,
            hidden=case.hidden,
            topk=case.topk,
            max_tokens=case.max_tokens,
            wire=case.wire,
            group=group,
            **kw,
        )
        for r in range(case.world)
    ]
    _connect_all(eps, [ep.setup_blob() for ep in eps])
    return eps


def _connect_all(eps: list[ExpertParallel], blobs: list[bytes]) -> None:
    errors: list[BaseException] = []

    def go(ep: ExpertParallel) -> None:
        try:
            ep.connect(blobs)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(ep,)) for ep in eps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


def _round(eps: list[ExpertParallel], case: Case, round_: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """One full round driven from this thread (sends never block, so sequential calls are fine)."""
    tables = expert_tables(case)
    inputs = [rank_inputs(case, r, round_) for r in range(case.world)]
    for ep, (x, ids, _) in zip(eps, inputs, strict=True):
        ep.dispatch_send(x, ids)
    received = [ep.dispatch_recv() for ep in eps]
    for r, (ep, d) in enumerate(zip(eps, received, strict=True)):
        mine = (ep.expert_to_rank == r).nonzero().squeeze(1).tolist()
        for local, pairs in enumerate(d.expert_pairs()):
            if pairs.numel():
                d.out[pairs] = apply_expert(tables, mine[local], d.gather(pairs))
        ep.combine_send(d)
    ys = [ep.combine_recv(w) for ep, (_, _, w) in zip(eps, inputs, strict=True)]
    return ys, [d.expert_counts() for d in received]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=moe_cases(max_world=5), wire=st.sampled_from(["bf16", "fp8"]))
def test_transport_matches_reference(engines: list[TransferEngine], case: Case, wire: str) -> None:
    case = replace(case, wire=wire)
    eps = _group(engines, case, timeout_s=20.0)
    try:
        for round_ in range(2):
            ys, counts = _round(eps, case, round_)
            ref, ref_counts = reference(case, round_)
            assert counts == ref_counts
            for r, (a, b) in enumerate(zip(ys, ref, strict=True)):
                assert torch.equal(a, b), f"rank {r} round {round_} differs from the reference"
    finally:
        for ep in eps:
            ep.close()


def test_writes_split_into_chunks_stay_exact(caplog: pytest.LogCaptureFixture) -> None:
    """An engine with 4 KiB chunks splits every write (data first, then the immediate): still exact."""
    case = Case(world=3, num_experts=6, hidden=512, topk=3, max_tokens=16, seed=9)
    engs = [TransferEngine("tcp", 2, timeout_s=5.0, chunk_bytes=4096, reorder_for_test=True, host="127.0.0.1")
            for _ in range(case.world)]
    try:
        with caplog.at_level("WARNING", logger="backends.moe"):
            eps = _group(engs, case)
        assert "splits writes" in caplog.text
        for round_ in range(2):
            ys, _ = _round(eps, case, round_)
            ref, _ = reference(case, round_)
            assert all(torch.equal(a, b) for a, b in zip(ys, ref, strict=True))
        for ep in eps:
            ep.close()
    finally:
        for e in engs:
            e.close()


def test_misuse_and_bad_input_leave_the_group_usable(engines: list[TransferEngine]) -> None:
    case = Case(world=2, num_experts=4, hidden=16, topk=2, max_tokens=4, routing="uniform")
    eps = _group(engines, case)
    x, ids, w = rank_inputs(case, 0, 0)
    with pytest.raises(MoEError, match="dispatch_recv called in state 'idle'"):
        eps[0].dispatch_recv()
    with pytest.raises(ValueError, match="x must be bf16"):
        eps[0].dispatch_send(x.float(), ids)
    with pytest.raises(ValueError, match="topk_ids must be"):
        eps[0].dispatch_send(x, ids[:, :1])
    with pytest.raises(ValueError, match="expert ids outside"):
        eps[0].dispatch_send(x, ids + 10)
    with pytest.raises(ValueError, match="exceed max_tokens"):
        eps[0].dispatch_send(torch.cat([x, x]), torch.cat([ids, ids]))
    ys, _ = _round(eps, case, 0)  # still works, and still exact
    ref, _ = reference(case, 0)
    assert all(torch.equal(a, b) for a, b in zip(ys, ref, strict=True))
    for ep in eps:
        ep.close()


def test_connect_names_the_mismatched_setting(engines: list[TransferEngine]) -> None:
    group = f"g{next(_groups)}"
    a = ExpertParallel(
        engines[0], rank=0, world_size=2, num_experts=4, hidden=16, topk=2, max_tokens=4, group=group
    )
    b = ExpertParallel(
        engines[1], rank=1, world_size=2, num_experts=4, hidden=32, topk=2, max_tokens=4, group=group
    )
    with pytest.raises(MoEError, match="rank 1 has hidden=32, rank 0 has 16"):
        a.connect([a.setup_blob(), b.setup_blob()])
    with pytest.raises(MoEError, match="malformed"):
        a.connect([a.setup_blob(), b"{not json"])
    with pytest.raises(MoEError, match="blob 0 belongs to rank 1"):
        a.connect([b.setup_blob(), b.setup_blob()])
    a.close()
    b.close()


def test_stalled_peer_is_a_timeout_naming_it(engines: list[TransferEngine]) -> None:
    case = Case(world=3, num_experts=6, hidden=8, topk=2, max_tokens=4, routing="uniform")
    eps = _group(engines, case, timeout_s=1.0)
    inputs = [rank_inputs(case, r, 0) for r in range(3)]
    eps[0].dispatch_send(inputs[0][0], inputs[0][1])
    eps[1].dispatch_send(inputs[1][0], inputs[1][1])  # rank 2 never sends
    t0 = time.monotonic()
    with pytest.raises(MoETimeout, match=r"tokens from rank\(s\) \[2\] not complete within 1s"):
        eps[0].dispatch_recv()
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(MoEError, match="broken group"):
        eps[0].combine_recv(inputs[0][2])
    # Rank 2 catches up: its data reaches rank 1, which is still healthy.
    eps[2].dispatch_send(inputs[2][0], inputs[2][1])
    eps[1].dispatch_recv()
    for ep in eps:
        ep.close()


# ----- 3. four real processes ----------------------------------------------------------------------
class Ranks:
    """world spawned ranks (tests/backends/moe_worker.py), blobs exchanged through their pipes."""

    def __init__(self, case: Case, provider: str, rounds: int, **opts: Any) -> None:
        self.pipes = []
        self.procs = []
        for r in range(case.world):
            parent, child = CTX.Pipe()
            proc = CTX.Process(target=run_rank, args=(child, case, r, provider, rounds, opts), daemon=True)
            proc.start()
            child.close()
            self.pipes.append(parent)
            self.procs.append(proc)
        blobs = [self.recv(r, 120) for r in range(case.world)]
        assert all(b[0] == "blobs" for b in blobs), blobs
        per_group = list(zip(*[b[1] for b in blobs], strict=True))  # [group][rank]
        for p in self.pipes:
            p.send([list(g) for g in per_group])

    def recv(self, r: int, timeout: float) -> Any:
        if not self.pipes[r].poll(timeout):
            raise TimeoutError(f"rank {r} said nothing within {timeout}s")
        msg = self.pipes[r].recv()
        if msg[0] == "error" and not getattr(self, "expect_errors", False):
            raise AssertionError(f"rank {r}: {msg[1]}\n{msg[2]}")
        return msg

    def stop(self) -> None:
        for p in self.pipes:
            with contextlib.suppress(OSError):
                p.send("exit")
        for proc in self.procs:
            proc.join(15)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


@pytest.mark.slow
@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_four_processes_match_reference(provider: str) -> None:
    """4 spawned ranks, a bf16 and an fp8 group on each engine, 6 rounds each cycling uniform,
    skewed, sparse (empty experts) and masked routings, token counts from 0 to max_tokens."""
    if provider not in PROVIDERS:
        pytest.skip(f"{provider} not in RFORK_TEST_PROVIDERS")
    _skip_unless(provider)
    case = Case(world=4, num_experts=16, hidden=96, topk=4, max_tokens=24, seed=3)
    rounds, wires = 6, ["bf16", "fp8"]
    ranks = Ranks(case, provider, rounds, wires=wires)
    saw_empty_expert = saw_empty_rank = False
    try:
        for wire in wires:
            wcase = replace(case, wire=wire)
            for round_ in range(rounds):
                ref, ref_counts = reference(wcase, round_)
                for r in range(case.world):
                    kind, got_wire, got_round, y, counts, source_tokens = ranks.recv(r, 60)
                    assert (kind, got_wire, got_round) == ("round", wire, round_)
                    assert torch.equal(y, ref[r]), (
                        f"{wire} rank {r} round {round_} differs from the reference"
                    )
                    assert counts == ref_counts[r]
                    saw_empty_expert |= 0 in counts
                    saw_empty_rank |= 0 in source_tokens
        assert all(ranks.recv(r, 30) == ("done",) for r in range(case.world))
    finally:
        ranks.stop()
    assert saw_empty_expert, "the routings should leave some expert without tokens"
    assert saw_empty_rank, "some rank should send no tokens in some round"


@pytest.mark.slow
def test_killed_rank_fails_the_others_within_bounded_time() -> None:
    """Rank 3 is SIGKILLed before round 2: the other ranks' round fails naming it, within the bound."""
    _skip_unless("tcp")
    case = Case(world=4, num_experts=8, hidden=32, topk=2, max_tokens=8, seed=5)
    ranks = Ranks(case, "tcp", 4, stall_rank=3, stall_after=2, timeout_s=3.0)
    ranks.expect_errors = True  # type: ignore[attr-defined]
    try:
        for round_ in range(2):
            for r in range(4):
                assert ranks.recv(r, 60)[0] == "round", f"round {round_} rank {r}"
        assert ranks.recv(3, 30) == ("stalled",)
        ranks.procs[3].kill()
        t0 = time.monotonic()
        for r in range(3):
            msg = ranks.recv(r, 30)
            assert msg[0] == "error", msg
            assert "rank 3" in msg[1] or "[3]" in msg[1], msg[1]
        assert time.monotonic() - t0 < 20.0
    finally:
        ranks.stop()
