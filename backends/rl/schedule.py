"""The static write schedule: which trainer bytes go to which receiver bytes, computed once per pair.

For every tensor, each rank holds a contiguous range of the split dim (all of it when replicated or
at TP=1). Viewing a tensor as (outer, mid, inner) around that dim, the overlap of a trainer's range
with a receiver's range is `outer` equal segments, one per outer index: a strided run, which one
`write_paged` (or one `write` when contiguous) posts. This covers TP=2 -> TP=1, TP=1 -> TP=2 and any
other pair of TP sizes. Where several trainers hold the same bytes (replicas, replicated tensors)
large overlaps are split between them and small ones go to the least-loaded holder, so every
destination byte is written exactly once and the bytes spread over the trainers. Adjacent runs of
one trainer are merged (across layout padding too), so a same-TP pair needs a few writes per region.

A receiver computes its own schedule with the same function, so both sides agree on how many
trainers contribute to it (the count its completion immediate waits for) without asking.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from backends.layout import ALIGN, Layout, dtype_from_name
from backends.rl.spec import RLError, TensorSpec
from backends.sharding import shard_range

SPLIT_MIN_BYTES = 256 << 10  # overlaps held by several trainers are split between them from this size


@dataclass(frozen=True, slots=True)
class RankShard:
    """A rank's place in the session: TP position and where its shards sit (its layout)."""

    tp_size: int
    tp_rank: int
    layout: Layout


@dataclass(frozen=True, slots=True)
class Run:
    """`count` segments of `length` bytes: segment k goes from trainer region `src_region` at
    src_offset + k*src_stride to receiver region `dst_region` at dst_offset + k*dst_stride."""

    trainer: int
    src_region: int
    src_offset: int
    dst_region: int
    dst_offset: int
    length: int
    count: int = 1
    src_stride: int = 0
    dst_stride: int = 0

    @property
    def nbytes(self) -> int:
        """Payload bytes the run moves."""
        return self.length * self.count


@dataclass(frozen=True, slots=True)
class ReceiverSchedule:
    """Every run that fills one receiver rank, in posting order."""

    receiver: int
    runs: tuple[Run, ...]

    @property
    def contributors(self) -> tuple[int, ...]:
        """Trainer indices with at least one run here (each sends one completion immediate)."""
        return tuple(sorted({r.trainer for r in self.runs}))

    def runs_for(self, trainer: int) -> tuple[Run, ...]:
        """The runs trainer `trainer` posts."""
        return tuple(r for r in self.runs if r.trainer == trainer)

    def bytes_by_trainer(self) -> dict[int, int]:
        """Payload bytes per trainer index."""
        out: dict[int, int] = {}
        for r in self.runs:
            out[r.trainer] = out.get(r.trainer, 0) + r.nbytes
        return out


def _geometry(spec: TensorSpec) -> tuple[int, int, int]:
    """(outer, mid, inner bytes) of a tensor around its split dim (dim 0 when replicated)."""
    elem = dtype_from_name(spec.dtype).itemsize
    if not spec.shape:
        return 1, 1, elem
    dim = 0 if spec.split_dim is None else spec.split_dim
    return math.prod(spec.shape[:dim]), spec.shape[dim], math.prod(spec.shape[dim + 1 :]) * elem


def _held(spec: TensorSpec, mid: int, shard: RankShard) -> tuple[int, int]:
    if spec.split_dim is None or shard.tp_size == 1:
        return 0, mid
    return shard_range(mid, shard.tp_size, shard.tp_rank)


def build_receiver_schedule(
    specs: Sequence[TensorSpec],
    trainers: Sequence[RankShard],
    receiver: RankShard,
    *,
    receiver_index: int = 0,
    split_min_bytes: int = SPLIT_MIN_BYTES,
) -> ReceiverSchedule:
    """The runs that write every byte of `receiver`'s shards exactly once from `trainers`' shards.

    Deterministic in its arguments. Raises RLError when no trainer holds some destination bytes or
    a layout does not match the specs.
    """
    if not trainers:
        raise RLError("schedule: the session has no trainers")
    for who, shard in [("receiver", receiver), *((f"trainer {i}", t) for i, t in enumerate(trainers))]:
        if len(shard.layout.placements) != len(specs):
            raise RLError(
                f"schedule: {who}'s layout has {len(shard.layout.placements)} tensors, specs {len(specs)}"
            )
    # Pass 1: elementary pieces (a tensor's rows [a, b) of the split dim) and who holds each.
    pieces: list[tuple[int, int, int, tuple[int, ...]]] = []
    for i, spec in enumerate(specs):
        dst = receiver.layout.placements[i]
        if dst.name != spec.name:
            raise RLError(f"schedule: receiver's tensor {i} is {dst.name!r}, specs say {spec.name!r}")
        for t, shard in enumerate(trainers):
            if shard.layout.placements[i].name != spec.name:
                raise RLError(f"schedule: trainer {t}'s tensor {i} is not {spec.name!r}")
        if dst.nbytes == 0:
            continue
        _, mid, _ = _geometry(spec)
        dlo, dhi = _held(spec, mid, receiver)
        held = [_held(spec, mid, t) for t in trainers]
        cuts = sorted({dlo, dhi, *(min(max(x, dlo), dhi) for rng in held for x in rng)})
        for a, b in zip(cuts, cuts[1:], strict=False):
            holders = tuple(t for t, (lo, hi) in enumerate(held) if lo <= a and b <= hi)
            if not holders:
                raise RLError(
                    f"schedule: no trainer holds {spec.name!r} rows [{a}, {b}) of dim "
                    f"{spec.split_dim or 0} for receiver {receiver_index} "
                    f"(tp {receiver.tp_rank}/{receiver.tp_size})"
                )
            pieces.append((i, a, b, holders))
    # Pass 2: bytes held by several trainers are dealt out in contiguous stripes, an equal quota
    # per holder (starting at a different holder per receiver), so each trainer's share stays a
    # few long writes; a stripe boundary splits a piece only where both parts are big enough.
    totals: dict[tuple[int, ...], int] = {}
    for i, a, b, holders in pieces:
        outer, _, inner = _geometry(specs[i])
        totals[holders] = totals.get(holders, 0) + (b - a) * outer * inner
    turn: dict[tuple[int, ...], list[int]] = {h: [0, 0] for h in totals}  # [holders filled, bytes]
    runs: list[Run] = []
    for i, a, b, holders in pieces:
        spec = specs[i]
        outer, _, inner = _geometry(spec)
        row = outer * inner
        k = len(holders)
        quota = -(-totals[holders] // k)
        state = turn[holders]
        while a < b:
            t = holders[(receiver_index + state[0]) % k]
            take = b - a
            if state[0] < k - 1:  # the last holder takes whatever remains
                fit = max(1, round((quota - state[1]) / row))
                if fit < take and min(fit, take - fit) * row >= split_min_bytes:
                    take = fit
            runs.append(_run(spec, trainers, receiver, t, i, a, a + take))
            a += take
            state[1] += take * row
            if state[0] < k - 1 and state[1] >= quota:
                state[0] += 1
                state[1] = 0
    return ReceiverSchedule(receiver=receiver_index, runs=tuple(_merge(runs, receiver.layout)))


def _run(
    spec: TensorSpec, trainers: Sequence[RankShard], receiver: RankShard, t: int, i: int, a: int, b: int
) -> Run:
    """Rows [a, b) of tensor i's split dim, from trainer t to the receiver."""
    outer, mid, inner = _geometry(spec)
    slo, shi = _held(spec, mid, trainers[t])
    dlo, dhi = _held(spec, mid, receiver)
    src = trainers[t].layout.placements[i]
    dst = receiver.layout.placements[i]
    run = Run(
        trainer=t,
        src_region=src.region,
        src_offset=src.offset + (a - slo) * inner,
        dst_region=dst.region,
        dst_offset=dst.offset + (a - dlo) * inner,
        length=(b - a) * inner,
        count=outer,
        src_stride=(shi - slo) * inner,
        dst_stride=(dhi - dlo) * inner,
    )
    return _contiguous(run)


def _contiguous(run: Run) -> Run:
    """One plain segment when the strided run is contiguous on both sides."""
    if run.count == 1 or run.length == run.src_stride == run.dst_stride:
        n = run.nbytes
        return Run(run.trainer, run.src_region, run.src_offset, run.dst_region, run.dst_offset, n, 1, 0, 0)
    return run


def _merge(runs: Sequence[Run], dst_layout: Layout) -> list[Run]:
    """Merge each plain run into its trainer's previous one when both sides continue it.

    A gap below the layout alignment, equal on both sides and holding no destination tensor
    bytes (layout padding), is merged over: writing padding is harmless and saves an op.
    """
    occupied: dict[int, tuple[list[int], list[int]]] = {}
    for p in sorted(dst_layout.placements, key=lambda p: (p.region, p.offset)):
        if p.nbytes:
            starts, ends = occupied.setdefault(p.region, ([], []))
            starts.append(p.offset)
            ends.append(p.offset + p.nbytes)

    def padding(region: int, lo: int, hi: int) -> bool:
        starts, ends = occupied.get(region, ([], []))
        k = bisect_left(starts, hi) - 1
        return k < 0 or ends[k] <= lo

    out: list[Run] = []
    last: dict[int, int] = {}
    for run in runs:
        j = last.get(run.trainer)
        if j is not None and run.count == 1:
            prev = out[j]
            end = prev.dst_offset + prev.length
            gap = run.dst_offset - end
            if (
                prev.count == 1
                and prev.src_region == run.src_region
                and prev.dst_region == run.dst_region
                and run.src_offset - (prev.src_offset + prev.length) == gap
                and 0 <= gap < ALIGN
                and (gap == 0 or padding(run.dst_region, end, run.dst_offset))
            ):
                length = run.dst_offset + run.length - prev.dst_offset
                out[j] = Run(
                    prev.trainer, prev.src_region, prev.src_offset, prev.dst_region, prev.dst_offset, length
                )
                continue
        last[run.trainer] = len(out)
        out.append(run)
    return out
