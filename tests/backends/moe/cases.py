"""Deterministic MoE test cases (tokens, routings, weights, experts) that every process can regenerate."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.moe.routing import expert_placement, moe_reference

ROUTINGS = ("uniform", "skewed", "sparse", "masked")
MIXED = "mixed"  # a different routing each round, in ROUTINGS order


@dataclass(frozen=True)
class Case:
    world: int
    num_experts: int
    hidden: int
    topk: int
    max_tokens: int
    routing: str = MIXED
    seed: int = 0
    wire: str = "bf16"


def routing_ids(g: torch.Generator, t: int, case: Case, routing: str) -> torch.Tensor:
    """[t, k] distinct expert ids per token (-1 where masked), drawn by the case's routing.

    uniform: any experts; skewed: a few hot experts take most tokens (Zipf-like scores); sparse:
    only a quarter of the experts are ever chosen, so whole ranks may get nothing; masked: like
    uniform with about a third of the slots set to -1.
    """
    e, k = case.num_experts, case.topk
    if routing == "sparse":
        allowed = torch.randperm(e, generator=g)[: max(k, e // 4)]
        scores = torch.rand(t, allowed.numel(), generator=g)
        return allowed[scores.topk(k, dim=1).indices]
    scores = torch.rand(t, e, generator=g)
    if routing == "skewed":
        scores = scores * (1.0 / torch.arange(1, e + 1, dtype=torch.float32)) ** 2
    ids = scores.topk(k, dim=1).indices
    if routing == "masked":
        ids = torch.where(torch.rand(t, k, generator=g) < 0.35, -1, ids)
    return ids


def rank_inputs(case: Case, rank: int, round_: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [T, H] bf16, topk_ids [T, k], weights [T, k] fp32) for one rank and round.

    T varies: max_tokens every third round, 0 for rank 1 in round 1, random otherwise.
    """
    g = torch.Generator().manual_seed(case.seed * 1_000_003 + round_ * 1009 + rank)
    t = int(torch.randint(0, case.max_tokens + 1, (1,), generator=g))
    if round_ % 3 == 0:
        t = case.max_tokens
    if round_ == 1 and rank == 1:
        t = 0
    x = (torch.randn(t, case.hidden, generator=g) * 4).to(torch.bfloat16)
    routing = ROUTINGS[round_ % len(ROUTINGS)] if case.routing == MIXED else case.routing
    ids = routing_ids(g, t, case, routing)
    weights = torch.softmax(torch.randn(t, case.topk, generator=g), dim=1)
    return x, ids, weights


def expert_tables(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert scale and bias rows [E, H]: expert e computes x * a[e] + b[e] in fp32, row by row."""
    g = torch.Generator().manual_seed(case.seed + 77)
    a = torch.rand(case.num_experts, case.hidden, generator=g) + 0.5
    b = torch.randn(case.num_experts, case.hidden, generator=g)
    return a, b


def apply_expert(tables: tuple[torch.Tensor, torch.Tensor], e: int, rows: torch.Tensor) -> torch.Tensor:
    """Expert e on rows [n, H] (bf16 in, bf16 out); row-wise, so batch composition cannot matter."""
    a, b = tables
    return (rows.to(torch.float32) * a[e] + b[e]).to(torch.bfloat16)


def reference(case: Case, round_: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Reference outputs per rank, and per rank the pair count of each of its local experts."""
    inputs = [rank_inputs(case, r, round_) for r in range(case.world)]
    tables = expert_tables(case)
    ref = moe_reference(
        [i[0] for i in inputs],
        [i[1] for i in inputs],
        [i[2] for i in inputs],
        lambda e, rows: apply_expert(tables, e, rows),
        wire=case.wire,
    )
    to_rank, _ = expert_placement(case.num_experts, case.world)
    ids = torch.cat([i[1] for i in inputs]).flatten()
    per_expert = torch.bincount(ids[ids >= 0], minlength=case.num_experts)
    counts = [per_expert[to_rank == r].tolist() for r in range(case.world)]
    return ref, counts
