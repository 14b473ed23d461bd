"""Routing-plan math for expert-parallel MoE dispatch/combine, and the single-process reference.

Pure torch on CPU tensors, no transport: `backends.moe` moves the bytes these plans describe, and
the tests check both against `moe_reference`.

Conventions (shared by sender, receiver and reference, so results match bit for bit):
- A *pair* is (token t, top-k slot j) with `topk_ids[t, j] >= 0`; -1 marks a masked slot.
- A token travels once to each rank that owns at least one of its experts; the receiver learns
  which of its experts to apply from the token's expert-id row (-1 where the slot is elsewhere).
- Pairs are ordered by (rank, t, j) at the sender and (source rank, t, j) at the receiver, so the
  expert outputs a rank sends back for one source are one contiguous block at the source.
- Combine reduces in fp32, slot by slot in j order: `acc = acc + w[t, j] * y[t, j]`, then casts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

WIRE_DTYPES = ("bf16", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def expert_placement(
    num_experts: int, world_size: int, expert_to_rank: Sequence[int] | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert → rank, expert → local index among its rank's experts), both int64 [num_experts].

    Default placement: contiguous, balanced blocks (expert e on rank e * world_size // num_experts).
    """
    if num_experts < 1 or world_size < 1:
        raise ValueError(f"num_experts ({num_experts}) and world_size ({world_size}) must be >= 1")
    if expert_to_rank is None:
        to_rank = torch.arange(num_experts, dtype=torch.int64) * world_size // num_experts
    else:
        to_rank = torch.as_tensor(expert_to_rank, dtype=torch.int64).flatten()
        if to_rank.numel() != num_experts:
            raise ValueError(f"expert_to_rank has {to_rank.numel()} entries for {num_experts} experts")
        if to_rank.numel() and (int(to_rank.min()) < 0 or int(to_rank.max()) >= world_size):
            raise ValueError(f"expert_to_rank names ranks outside [0, {world_size})")
    to_local = torch.empty(num_experts, dtype=torch.int64)
    for r in range(world_size):
        mine = (to_rank == r).nonzero().squeeze(1)
        to_local[mine] = torch.arange(mine.numel())
    return to_rank, to_local


def check_topk_ids(topk_ids: torch.Tensor, num_experts: int, what: str = "topk_ids") -> None:
    """ValueError unless topk_ids is an integer [T, k] tensor of expert ids in [-1, num_experts)."""
    if topk_ids.dim() != 2 or topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(
            f"{what} must be an integer [T, k] tensor, not {topk_ids.dtype} {list(topk_ids.shape)}"
        )
    if topk_ids.numel() and (int(topk_ids.min()) < -1 or int(topk_ids.max()) >= num_experts):
        raise ValueError(f"{what} holds expert ids outside [-1, {num_experts})")


@dataclass(frozen=True)
class SendPlan:
    """Where one rank's tokens go and where their expert outputs come back.

    dest_tokens[r]: token indices (ascending) sent to rank r.
    dest_ids[r]: [len(dest_tokens[r]), k] int32, the token's expert ids owned by r, -1 elsewhere.
    pair_counts[r]: pairs (token, slot) served by rank r; combine_offsets[r]: first row of rank r's
    block in the combine receive buffer (exclusive prefix sum of pair_counts).
    pair_slot: [T, k] int64, the combine-receive row of each pair, -1 for masked slots.
    """

    dest_tokens: list[torch.Tensor]
    dest_ids: list[torch.Tensor]
    pair_counts: list[int]
    combine_offsets: list[int]
    pair_slot: torch.Tensor

    @property
    def total_pairs(self) -> int:
        """Rows the combine receive buffer needs for this round."""
        return sum(self.pair_counts)


def plan_dispatch(topk_ids: torch.Tensor, expert_to_rank: torch.Tensor, world_size: int) -> SendPlan:
    """The sender's plan for topk_ids [T, k] (expert ids, -1 = masked); the same few torch ops for any P."""
    ids = topk_ids.to(torch.int64)
    t_count, k = ids.shape
    valid = ids >= 0
    ranks = torch.where(valid, expert_to_rank[ids.clamp(min=0)], -1)
    # hit[r, t, j]: pair (t, j) is served by rank r. Row-major order over [P, T, k] is (rank, t, j),
    # the combine slot order, so a running count numbers the pairs.
    hit = ranks.unsqueeze(0) == torch.arange(world_size).view(world_size, 1, 1)
    numbered = hit.reshape(-1).cumsum(0).view(world_size, t_count, k) - 1
    pair_slot = torch.where(valid, (numbered * hit).sum(0), -1)
    pair_counts = [int(c) for c in hit.sum((1, 2)).tolist()]
    offsets = [0] * world_size
    for r in range(1, world_size):
        offsets[r] = offsets[r - 1] + pair_counts[r - 1]
    token_hit = hit.any(2)  # [P, T]
    dest_rank, dest_token = token_hit.nonzero(as_tuple=True)  # ordered by rank, then token
    dest_ids = torch.where(hit[dest_rank, dest_token], ids[dest_token], -1).to(torch.int32)
    sizes = [int(c) for c in token_hit.sum(1).tolist()]
    return SendPlan(
        list(torch.split(dest_token, sizes)),
        list(torch.split(dest_ids, sizes)),
        pair_counts,
        offsets,
        pair_slot,
    )


@dataclass(frozen=True)
class RecvPlan:
    """The pairs a rank serves in one round, in (source rank, t, j) order.

    pair_row[m]: the receive row holding pair m's token; pair_expert[m]: its local expert index;
    source_pairs[s]: how many pairs came from source s (their outputs go back as one block).
    """

    pair_row: torch.Tensor
    pair_expert: torch.Tensor
    source_pairs: list[int]

    @property
    def total_pairs(self) -> int:
        """Rows of expert output this rank sends back."""
        return int(self.pair_row.numel())


def plan_receive(
    ids_by_source: Sequence[torch.Tensor],
    row_base: Sequence[int],
    expert_to_rank: torch.Tensor,
    expert_to_local: torch.Tensor,
    rank: int,
) -> RecvPlan:
    """The receiver's plan from each source's expert-id rows ([n_s, k], -1 = not here).

    row_base[s] is the receive row of source s's first token. ValueError if a source routed a token
    to an expert this rank does not own (mismatched placement or a corrupt buffer).
    """
    rows: list[torch.Tensor] = []
    experts: list[torch.Tensor] = []
    source_pairs: list[int] = []
    for s, ids in enumerate(ids_by_source):
        ids = ids.to(torch.int64)
        tok, slot = (ids >= 0).nonzero(as_tuple=True)
        global_ids = ids[tok, slot]
        if global_ids.numel() and (
            int(global_ids.max()) >= expert_to_rank.numel()
            or bool((expert_to_rank[global_ids] != rank).any())
        ):
            raise ValueError(f"rank {rank}: source rank {s} sent tokens for experts this rank does not own")
        rows.append(tok + row_base[s])
        experts.append(expert_to_local[global_ids])
        source_pairs.append(int(tok.numel()))
    empty = torch.empty(0, dtype=torch.int64)
    return RecvPlan(
        torch.cat(rows) if rows else empty, torch.cat(experts) if experts else empty, source_pairs
    )


def group_by_expert(pair_expert: torch.Tensor, num_local_experts: int) -> list[torch.Tensor]:
    """For each local expert, the indices of its pairs (ascending, so inputs keep source order)."""
    order = torch.argsort(pair_expert, stable=True)
    counts = torch.bincount(pair_expert, minlength=num_local_experts).tolist()
    return list(torch.split(order, counts))


REDUCE_BLOCK_TOKENS = 32  # fp32 scratch of 32 x 7168 stays in L2; whole-tensor passes were ~1.7x slower


def combine_reduce(
    rows: torch.Tensor, pair_slot: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """out[t] = sum over j of weights[t, j] * rows[pair_slot[t, j]], fp32, j in order; skips masked.

    Runs on rows' device (pair_slot and weights are moved there). Works through blocks of tokens
    with reused scratch, in place; each step rounds exactly as
    `acc + w * y.float()` does, so the result matches moe_reference bit for bit.
    """
    t_count, k = pair_slot.shape
    hidden = rows.shape[1]
    pair_slot = pair_slot.to(rows.device)
    w = weights.to(device=rows.device, dtype=torch.float32)
    valid = pair_slot >= 0
    all_valid = bool(valid.all())
    if rows.shape[0] == 0:  # every slot masked
        return torch.zeros(t_count, hidden, dtype=out_dtype, device=rows.device)
    out = torch.empty(t_count, hidden, dtype=out_dtype, device=rows.device)
    block = min(REDUCE_BLOCK_TOKENS, max(t_count, 1))
    acc = torch.empty(block, hidden, dtype=torch.float32, device=rows.device)
    y = torch.empty(block, hidden, dtype=rows.dtype, device=rows.device)
    term = torch.empty(block, hidden, dtype=torch.float32, device=rows.device)
    slots = pair_slot.clamp(min=0)
    for b0 in range(0, t_count, block):
        n = min(block, t_count - b0)
        a, yb, tb = acc[:n], y[:n], term[:n]
        a.zero_()
        for j in range(k):
            torch.index_select(rows, 0, slots[b0 : b0 + n, j], out=yb)
            torch.mul(yb, w[b0 : b0 + n, j : j + 1], out=tb)  # bf16 * fp32 computes in fp32
            if all_valid:
                a.add_(tb)
            else:
                a.copy_(torch.where(valid[b0 : b0 + n, j : j + 1], a + tb, a))
        out[b0 : b0 + n].copy_(a)
    return out


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token float8_e4m3fn: (q [n, H], scale [n] fp32) with x ≈ q * scale; zero rows get scale 1."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=1) if xf.shape[1] else torch.zeros(xf.shape[0])
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / scale.unsqueeze(1)).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of quantize_fp8 (up to fp8 rounding), cast to out_dtype."""
    return (q.to(torch.float32) * scale.to(torch.float32).unsqueeze(1)).to(out_dtype)


ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def moe_reference(
    xs: Sequence[torch.Tensor],
    topk_ids: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    expert_fn: ExpertFn,
    *,
    wire: str = "bf16",
) -> list[torch.Tensor]:
    """Single-process MoE: gather every rank's tokens, apply each expert to its tokens, scatter back.

    expert_fn(global_expert_id, rows [n, H]) -> [n, H]; it sees the tokens routed to that expert in
    (rank, token) order, the order an expert-parallel rank sees them. Returns one [T_r, H] tensor per
    rank. With wire="fp8" the experts see the tokens after an fp8 round trip, as on the wire.
    """
    if wire not in WIRE_DTYPES:
        raise ValueError(f"wire must be one of {WIRE_DTYPES}, not {wire!r}")
    sizes = [int(x.shape[0]) for x in xs]
    x_all = torch.cat(list(xs))
    if wire == "fp8":
        x_all = dequantize_fp8(*quantize_fp8(x_all), out_dtype=x_all.dtype)
    ids = torch.cat([t.to(torch.int64) for t in topk_ids])
    w = torch.cat([t.to(torch.float32) for t in weights])
    n, k = ids.shape
    outputs = torch.zeros(n, k, x_all.shape[1], dtype=x_all.dtype)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        outputs[tok, slot] = expert_fn(int(e), x_all[tok])
    acc = torch.zeros(n, x_all.shape[1], dtype=torch.float32)
    for j in range(k):
        valid = (ids[:, j] >= 0).unsqueeze(1)
        acc = torch.where(valid, acc + w[:, j : j + 1] * outputs[:, j].to(torch.float32), acc)
    return list(torch.split(acc.to(x_all.dtype), sizes))
