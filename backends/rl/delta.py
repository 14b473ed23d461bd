"""Weight deltas: only the 4-byte words that changed since the version a receiver's free slot holds.

After an optimizer step at a small learning rate most bf16 values do not change at all, so a trainer
that remembers what it sent (`Snapshots`, its last two versions: a receiver's free slot holds the
version before the one it serves) can send the changed words with their positions instead of whole
runs. A delta is encoded per receiver, in the order of that receiver's schedule runs, so the receiver
(which computes the same schedule) maps each run-local position back to its own bytes whatever the
two TP layouts are. Payload, one flat buffer:

    int64 count per run | int32 run-local word index per changed word | int32 new word per changed word

The receiver applies it into its free slot and checks the whole result against `runs_digest` of the
trainer's source bytes (xxh3-128 over every run's bytes in run order) before it flips: a wrong base,
a torn payload or a bug never becomes a served version.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xxhash

from backends.rl.schedule import Run
from backends.rl.spec import RLError

WORD = 4  # bytes compared and sent per position: a bf16 pair, an fp32 or two fp8s
_CHUNK_WORDS = 1 << 24  # compared at a time (64 MiB of words): bounds the temporary mask


def aligned(runs: Sequence[Run]) -> bool:
    """Whether every offset, length and stride of `runs` is whole words (a delta can address them)."""
    return all(
        v % WORD == 0
        for r in runs
        for v in (r.src_offset, r.dst_offset, r.length, r.src_stride, r.dst_stride)
    )


def _words(buf: torch.Tensor) -> torch.Tensor:
    n = buf.numel() - buf.numel() % WORD
    return buf[:n].view(torch.int32)


def changed_words(
    old: Sequence[torch.Tensor], new: Sequence[torch.Tensor], limit: int | None = None
) -> list[torch.Tensor] | None:
    """Per region, the sorted int64 indices of the words where `new` differs from `old` (flat uint8);
    None as soon as more than `limit` words differ (a step that changed most values costs one chunk's
    comparison, not an index of every word)."""
    out = []
    total = 0
    for o, n in zip(old, new, strict=True):
        ow, nw = _words(o), _words(n)
        parts = []
        for lo in range(0, nw.numel(), _CHUNK_WORDS):
            hi = min(lo + _CHUNK_WORDS, nw.numel())
            mask = ow[lo:hi] != nw[lo:hi]
            if limit is not None:
                total += int(torch.count_nonzero(mask))
                if total > limit:
                    return None
            idx = torch.nonzero(mask).flatten()
            if idx.numel():
                parts.append(idx + lo)
        out.append(torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64))
    return out


def _select(positions: torch.Tensor, run: Run, offset: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(run-local word index, index into `positions`) of the changed words inside `run`'s segments,
    where the segments start at `offset` + k*`stride` (both in bytes)."""
    lo = offset // WORD
    span = (run.count - 1) * stride + run.length
    a = int(torch.searchsorted(positions, lo))
    b = int(torch.searchsorted(positions, lo + span // WORD))
    rel = positions[a:b] - lo
    which = torch.arange(a, b, dtype=torch.int64)
    length = run.length // WORD
    if run.count == 1:
        return rel, which
    step = stride // WORD
    seg = torch.div(rel, step, rounding_mode="floor")
    within = rel - seg * step
    keep = within < length
    return (seg * length + within)[keep], which[keep]


def delta_capacity_bytes(runs: Sequence[Run], changed: int) -> int:
    """Payload bytes of a delta of `changed` words over `runs`."""
    return 8 * len(runs) + 2 * WORD * changed


def encode(
    runs: Sequence[Run],
    changed: Sequence[torch.Tensor],
    new: Sequence[torch.Tensor],
    out: torch.Tensor,
) -> int | None:
    """Write the delta of `runs` (source side: trainer regions) into `out` (flat uint8); its byte count,
    or None when it would not fit `out` (send the runs whole instead)."""
    counts = []
    local: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    total = 0
    words = [_words(b) for b in new]
    for run in runs:
        pos, which = _select(changed[run.src_region], run, run.src_offset, run.src_stride)
        counts.append(pos.numel())
        total += pos.numel()
        if delta_capacity_bytes(runs, total) > out.numel():
            return None
        local.append(pos)
        values.append(words[run.src_region][changed[run.src_region][which]])
    nbytes = delta_capacity_bytes(runs, total)
    head = 8 * len(runs)
    out[:head].view(torch.int64).copy_(torch.tensor(counts, dtype=torch.int64))
    if total:
        out[head : head + WORD * total].view(torch.int32).copy_(torch.cat(local))
        out[head + WORD * total : nbytes].view(torch.int32).copy_(torch.cat(values))
    return nbytes


def apply(runs: Sequence[Run], payload: torch.Tensor, dst: Sequence[torch.Tensor]) -> int:
    """Scatter a delta (as `encode` wrote it) into the receiver regions `dst`; the number of words written.
    RLError, with nothing written, when the payload does not describe `runs` (its sizes or positions)."""
    head = 8 * len(runs)
    if payload.numel() < head:
        raise RLError(f"delta of {payload.numel()} bytes is shorter than its {len(runs)} run counts")
    counts = payload[:head].view(torch.int64).tolist()
    total = sum(counts)
    if min(counts, default=0) < 0 or delta_capacity_bytes(runs, total) != payload.numel():
        raise RLError(f"delta of {payload.numel()} bytes does not hold the {total} words its counts name")
    positions = payload[head : head + WORD * total].view(torch.int32).to(torch.int64)
    values = payload[head + WORD * total :].view(torch.int32)
    plan = []
    at = 0
    for run, count in zip(runs, counts, strict=True):
        pos = positions[at : at + count]
        if count and (int(pos.min()) < 0 or int(pos.max()) >= run.count * (run.length // WORD)):
            raise RLError(f"delta names a word outside run {run} ({count} words)")
        length = run.length // WORD
        if run.count == 1:
            where = pos + run.dst_offset // WORD
        else:
            seg = torch.div(pos, length, rounding_mode="floor")
            where = seg * (run.dst_stride // WORD) + (pos - seg * length) + run.dst_offset // WORD
        plan.append((run.dst_region, where, values[at : at + count]))
        at += count
    words = [_words(b) for b in dst]
    for region, where, vals in plan:
        words[region][where] = vals
    return total


def runs_digest(runs: Sequence[Run], buffers: Sequence[torch.Tensor], *, source: bool) -> str:
    """xxh3-128 of every run's bytes in run order: the trainer's source bytes (source=True) or the
    receiver's destination bytes; equal exactly when the receiver holds what the trainer sent."""
    views = [b.numpy().data for b in buffers]
    h = xxhash.xxh3_128()
    for r in runs:
        region, offset, stride = (
            (r.src_region, r.src_offset, r.src_stride)
            if source
            else (r.dst_region, r.dst_offset, r.dst_stride)
        )
        view = views[region]
        for k in range(r.count):
            at = offset + k * stride
            h.update(view[at : at + r.length])
    return h.hexdigest()


class Snapshots:
    """The trainer's copies of its source buffers at the last two versions it sent, kept current by
    applying each update's changed words (a full copy only when no delta was computed from the oldest)."""

    KEEP = 2

    def __init__(self) -> None:
        self._held: dict[int, list[torch.Tensor]] = {}

    def versions(self) -> tuple[int, ...]:
        """The versions held, ascending."""
        return tuple(sorted(self._held))

    def get(self, version: int) -> list[torch.Tensor] | None:
        """The copy of `version`'s bytes, or None."""
        return self._held.get(version)

    def record(
        self,
        version: int,
        buffers: Sequence[torch.Tensor],
        changed_from: tuple[int, list[torch.Tensor]] | None,
    ) -> None:
        """Remember `buffers` as `version`. changed_from: (base, changed words) computed this update, which
        turns the base's copy into this version's by a scatter when the base is the copy to recycle."""
        if len(self._held) < self.KEEP:
            self._held[version] = [b.clone() for b in buffers]
            return
        oldest = min(self._held)
        copy = self._held.pop(oldest)
        if changed_from is not None and changed_from[0] == oldest:
            for c, b, idx in zip(copy, buffers, changed_from[1], strict=True):
                _words(c)[idx] = _words(b)[idx]
        else:
            for c, b in zip(copy, buffers, strict=True):
                c.copy_(b)
        self._held[version] = copy
