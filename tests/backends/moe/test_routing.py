"""backends.moe's routing plans alone, no transport: dispatch and combine simulated with torch ops must
equal the single-process reference, for any sizes, routings and expert placements (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.moe.routing import (
    combine_reduce,
    expert_placement,
    group_by_expert,
    plan_dispatch,
    plan_receive,
)
from tests.backends.moe.cases import (
    ROUTINGS,
    Case,
    apply_expert,
    expert_tables,
    rank_inputs,
    reference,
    routing_ids,
)


@st.composite
def moe_cases(draw: st.DrawFn, max_world: int = 6) -> Case:
    world = draw(st.integers(1, max_world))
    topk = draw(st.integers(1, 6))
    num_experts = draw(st.integers(topk, 24))
    return Case(
        world=world,
        num_experts=num_experts,
        hidden=draw(st.integers(1, 40)),
        topk=topk,
        max_tokens=draw(st.integers(1, 12)),
        routing=draw(st.sampled_from(ROUTINGS)),
        seed=draw(st.integers(0, 2**16)),
    )


def _simulate(case: Case, round_: int, placement: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Dispatch and combine through the plans alone: what the wire would carry, moved by torch ops."""
    to_rank, to_local = expert_placement(case.num_experts, case.world, placement)
    tables = expert_tables(case)
    inputs = [rank_inputs(case, r, round_) for r in range(case.world)]
    plans = [plan_dispatch(ids, to_rank, case.world) for _, ids, _ in inputs]
    outs: list[torch.Tensor] = []
    recv_plans = []
    for r in range(case.world):
        rows = torch.cat([inputs[s][0][plans[s].dest_tokens[r]] for s in range(case.world)])
        sizes = [int(plans[s].dest_tokens[r].numel()) for s in range(case.world)]
        bases = [sum(sizes[:s]) for s in range(case.world)]
        rp = plan_receive([plans[s].dest_ids[r] for s in range(case.world)], bases, to_rank, to_local, r)
        assert rp.source_pairs == [plans[s].pair_counts[r] for s in range(case.world)]
        mine = (to_rank == r).nonzero().squeeze(1).tolist()
        out = torch.zeros(rp.total_pairs, case.hidden, dtype=torch.bfloat16)
        for local, pairs in enumerate(group_by_expert(rp.pair_expert, len(mine))):
            if pairs.numel():
                out[pairs] = apply_expert(tables, mine[local], rows[rp.pair_row[pairs]])
        outs.append(out)
        recv_plans.append(rp)
    results = []
    for s in range(case.world):
        back = torch.zeros(plans[s].total_pairs, case.hidden, dtype=torch.bfloat16)
        for r in range(case.world):
            start = sum(recv_plans[r].source_pairs[:s])
            n = plans[s].pair_counts[r]
            off = plans[s].combine_offsets[r]
            back[off : off + n] = outs[r][start : start + n]
        results.append(combine_reduce(back, plans[s].pair_slot, inputs[s][2], torch.bfloat16))
    return results


@settings(max_examples=150, deadline=None)
@given(case=moe_cases(), round_=st.integers(0, 5))
def test_plan_math_matches_reference(case: Case, round_: int) -> None:
    got = _simulate(case, round_)
    ref, _ = reference(case, round_)
    for r, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert torch.equal(a, b), f"rank {r} differs from the reference"


@settings(max_examples=60, deadline=None)
@given(case=moe_cases(), round_=st.integers(0, 5), data=st.data())
def test_plan_math_with_any_placement(case: Case, round_: int, data: st.DataObject) -> None:
    """Arbitrary expert → rank maps, ranks owning no expert included."""
    placement = data.draw(
        st.lists(st.integers(0, case.world - 1), min_size=case.num_experts, max_size=case.num_experts)
    )
    got = _simulate(case, round_, torch.tensor(placement))
    ref, _ = reference(case, round_)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


@settings(max_examples=80, deadline=None)
@given(
    t=st.integers(0, 20),
    k=st.integers(1, 8),
    world=st.integers(1, 8),
    seed=st.integers(0, 999),
    routing=st.sampled_from(ROUTINGS),
)
def test_send_plan_invariants(t: int, k: int, world: int, seed: int, routing: str) -> None:
    case = Case(world=world, num_experts=max(k, 2 * world), hidden=1, topk=k, max_tokens=max(t, 1))
    ids = routing_ids(torch.Generator().manual_seed(seed), t, case, routing)
    to_rank, _ = expert_placement(case.num_experts, world)
    plan = plan_dispatch(ids, to_rank, world)
    valid = ids >= 0
    assert plan.total_pairs == int(valid.sum())
    slots = plan.pair_slot[valid]
    assert sorted(slots.tolist()) == list(range(plan.total_pairs)), "every pair gets exactly one slot"
    assert bool((plan.pair_slot[~valid] == -1).all())
    for r in range(world):
        hit = (to_rank[ids.clamp(min=0)] == r) & valid
        assert plan.dest_tokens[r].tolist() == hit.any(1).nonzero().squeeze(1).tolist()
        block = plan.pair_slot[hit]  # row-major: (t, j) order
        assert block.tolist() == list(range(plan.combine_offsets[r], plan.combine_offsets[r] + len(block)))


def test_receiver_refuses_experts_it_does_not_own() -> None:
    to_rank, to_local = expert_placement(8, 2)
    with pytest.raises(ValueError, match="source rank 0 sent tokens for experts this rank does not own"):
        plan_receive([torch.tensor([[0, 5]], dtype=torch.int32)], [0], to_rank, to_local, 1)


def test_placement_is_checked() -> None:
    with pytest.raises(ValueError, match="3 entries for 4 experts"):
        expert_placement(4, 2, [0, 1, 1])
    with pytest.raises(ValueError, match="outside"):
        expert_placement(4, 2, [0, 1, 2, 1])
