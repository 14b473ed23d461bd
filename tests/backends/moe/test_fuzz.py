"""A hostile MoE rank (hypothesis): rank 1 of a live two-rank group writes arbitrary header fields
(round, token count, combine offset, pair count) and expert ids into rank 0's receive slot over the
real transport. Rank 0 either computes a round or fails it with MoEError within its timeout: never
another exception, never a write outside a registered buffer; a fresh group then serves honestly.

MoE sends no two-sided messages: its data arrives by one-sided writes that need a descriptor from
the group's set-up blobs (only members get them), so every peer-written field is checked before use.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from backends import TransferEngine
from backends.moe import ExpertParallel, MoEError
from tests.backends.moe.cases import Case, reference
from tests.backends.moe.test_expert_parallel import _connect_all, _round

CASE = Case(world=2, num_experts=4, hidden=64, topk=2, max_tokens=8, seed=3)
_groups = itertools.count()


@pytest.fixture(scope="module")
def engines() -> Iterator[list[TransferEngine]]:
    engs = [
        TransferEngine("tcp", 1, timeout_s=2.0, chunk_bytes=64 << 20, host="127.0.0.1") for _ in range(2)
    ]
    yield engs
    for e in engs:
        e.close()


def _group(engs: list[TransferEngine]) -> list[ExpertParallel]:
    group = f"fuzz{next(_groups)}"
    eps = [
        ExpertParallel(
            engs[r], rank=r, world_size=2, num_experts=CASE.num_experts, hidden=CASE.hidden,
            topk=CASE.topk, max_tokens=CASE.max_tokens, group=group, timeout_s=1.0,
        )
        for r in range(2)
    ]
    _connect_all(eps, [ep.setup_blob() for ep in eps])
    return eps


_i64 = st.one_of(st.integers(-3, 20), st.integers(-(2**63), 2**63 - 1))
_i32 = st.one_of(st.integers(-3, 8), st.integers(-(2**31), 2**31 - 1))


@pytest.mark.timeout(300)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    header=st.lists(_i64, min_size=4, max_size=4),
    keep_round=st.booleans(),
    consistent=st.one_of(st.none(), st.integers(0, CASE.max_tokens)),
    ids=st.lists(
        st.one_of(st.sampled_from([-1, 0, 1]), _i32),
        min_size=CASE.max_tokens * CASE.topk, max_size=CASE.max_tokens * CASE.topk,
    ),
)
@example(header=[0, 0, 10**6, 0], keep_round=True, consistent=2, ids=[0] * 16)
@example(header=[0, 0, -1, 0], keep_round=True, consistent=8, ids=[1, -1] * 8)
def test_a_hostile_rank_never_crashes_its_peer_and_a_fresh_group_serves(
    engines: list[TransferEngine], header: list[int], keep_round: bool, consistent: int | None, ids: list[int]
) -> None:
    """consistent=n: the header's token and pair counts agree with the ids (n tokens), so only the
    combine offset and the ids themselves are hostile."""
    eps = _group(engines)
    r0, r1 = eps
    honest_pack = r1._pack

    def hostile_pack(
        views: Any, rows: torch.Tensor, scales: torch.Tensor | None, plan: Any, dest: int  # noqa: ANN401
    ) -> None:
        honest_pack(views, rows, scales, plan, dest)
        if dest == 0:  # what rank 1 writes into rank 0's receive buffer
            first = 1
            hostile_ids = torch.tensor(ids, dtype=torch.int32).view(-1, CASE.topk)
            views.ids[first : first + CASE.max_tokens] = hostile_ids
            h = list(header)
            if keep_round:
                h[0] = r1._round
            if consistent is not None:
                h[1] = consistent
                h[3] = int((hostile_ids[:consistent] >= 0).sum())
            views.headers[0] = torch.tensor(h, dtype=torch.int64)

    r1._pack = hostile_pack  # type: ignore[method-assign]
    x = torch.ones(CASE.max_tokens, CASE.hidden, dtype=torch.bfloat16)
    topk = torch.tensor([[0, 2]] * CASE.max_tokens)
    weights = torch.full((CASE.max_tokens, CASE.topk), 0.5)
    try:
        for ep in eps:
            ep.dispatch_send(x, topk)
        try:
            d0 = r0.dispatch_recv()
            d1 = r1.dispatch_recv()
            d0.out.zero_()
            d1.out.zero_()
            r0.combine_send(d0)
            r1.combine_send(d1)
            for ep in eps:
                y = ep.combine_recv(weights)
                assert y.shape == (CASE.max_tokens, CASE.hidden)
        except MoEError:
            pass  # refused (or timed out waiting for a peer that refused): bounded, and named
    finally:
        for ep in eps:
            ep.close()
    fresh = _group(engines)
    try:
        ys, _ = _round(fresh, CASE, 0)
        ref, _ = reference(CASE, 0)
        assert all(torch.equal(a, b) for a, b in zip(ys, ref, strict=True))
    finally:
        for ep in fresh:
            ep.close()
