"""Keep what already matches: a rollout reads only the tensors whose bytes differ from the seed's.

An instance that holds one version of a model (v1) and must serve another (v2) shares most tensors
with it: a fine-tune that froze most layers, a new revision that changed a few. With
`LoadOptions(keep_matching=True)` the loader digests the destination before it reads anything: each
tensor whose digest already equals the (anchored) digest in the seed's manifest is kept, and only the
others are read and verified as usual. A kept tensor is verified too: its own bytes were just hashed
to the digest the identity's anchor names, so nothing is trusted that was not compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from planner.contract import RankManifest
from rfork.weights import checksum as ck
from rfork.weights.rank_weights import RankWeights


@dataclass(frozen=True, kw_only=True)
class Split:
    """A destination split into what it keeps (already verified) and what must still be read."""

    to_read: RankWeights | None  # the tensors to read, in place in the destination; None: nothing
    manifest: RankManifest  # the seed's manifest restricted to those tensors
    kept_bytes: int  # distinct bytes kept (tied tensors count once)
    read_bytes: int  # distinct bytes still to read


def split_matching(dest: RankWeights, manifest: RankManifest, held: Mapping[str, str] | None = None) -> Split:
    """Digest every destination tensor (shared bytes once) and keep those equal to the manifest's digest.

    `held`: digests of what some tensors hold now, recorded when a load or seed verified them; trusted,
    so those are not hashed again. The kept digests are recorded in `dest.checksums` (the seed this
    instance becomes publishes them); the caller reads `to_read` from `manifest` with the usual
    verification, then `merge`s. The manifest must be checked against the destination
    (`rfork.pull.read_plan.check_destination`) first.
    """
    expected = {t.name: t.checksum for t in manifest.tensors}
    held = held or {}
    by_span: dict[tuple[int, int, int], list[str]] = {}
    for p in dest.layout.placements:
        by_span.setdefault((p.region, p.offset, p.nbytes), []).append(p.name)
    overlapping = _overlapping(list(by_span))
    to_hash = [span for span, names in by_span.items() if span not in overlapping and names[0] not in held]
    digests = _digest_all([dest.tensors[by_span[span][0]] for span in to_hash])
    got_by_span = dict(zip(to_hash, digests, strict=True))
    kept_bytes = read_bytes = 0
    changed: list[str] = []
    for span, names in by_span.items():
        nbytes = span[2]
        got = None if span in overlapping else got_by_span.get(span, held.get(names[0]))
        if got is not None and all(expected[name] == got for name in names):
            for name in names:
                dest.checksums[name] = got
            kept_bytes += nbytes
        else:
            changed.extend(names)
            read_bytes += nbytes
    if not changed:
        return Split(to_read=None, manifest=manifest, kept_bytes=kept_bytes, read_bytes=0)
    wanted = set(changed)
    sub_manifest = manifest.model_copy(update={"tensors": [t for t in manifest.tensors if t.name in wanted]})
    to_read = RankWeights.from_tensors(rank=dest.rank, tensors={n: dest.tensors[n] for n in changed})
    return Split(to_read=to_read, manifest=sub_manifest, kept_bytes=kept_bytes, read_bytes=read_bytes)


def _digest_all(tensors: list[torch.Tensor]) -> list[str]:
    """Each tensor's digest, several at once: BLAKE3 over many mid-sized tensors goes faster one tensor per
    thread than with its own threads on each (their start-up costs more than a small tensor's hash)."""
    if not tensors or tensors[0].device.type != "cpu" or ck.algorithm_for("cpu") != ck.BLAKE3:
        return [ck.tensor_checksum(t) for t in tensors]
    with ThreadPoolExecutor(max_workers=ck.blake3_threads(), thread_name_prefix="rfork-keep") as pool:
        return list(pool.map(lambda t: ck.blake3_bytes(t.reshape(-1).view(torch.uint8), threads=1), tensors))


def _overlapping(spans: list[tuple[int, int, int]]) -> set[tuple[int, int, int]]:
    """Spans that share some bytes with another span (not tied exactly: those are one span). Such a
    tensor is always read: writing its neighbour would change bytes it was kept for."""
    out: set[tuple[int, int, int]] = set()
    last: tuple[int, int, int] | None = None
    for span in sorted(s for s in spans if s[2]):
        if last is not None and last[0] == span[0] and span[1] < last[1] + last[2]:
            out.update((last, span))
        if last is None or last[0] != span[0] or span[1] + span[2] > last[1] + last[2]:
            last = span
    return out


def merge(dest: RankWeights, split: Split) -> None:
    """Record the digests the read verified in the whole destination (after a successful read)."""
    if split.to_read is not None:
        dest.checksums.update(split.to_read.checksums)


def split_shared(split: Split, other: RankManifest) -> tuple[Split | None, Split]:
    """Of what `split` still has to read, the tensors `other` (another identity's checked manifest: a
    seed of the version before) holds with the same digest, dtype and shape, as a Split to read from
    `other`; and the rest, to read from the seed of the identity asked for. Tied names move together.
    (None, split) when `other` shares nothing that is still to be read."""
    if split.to_read is None:
        return None, split
    mine = {t.name: t for t in split.manifest.tensors}
    theirs = {t.name: t for t in other.tensors}
    spans: dict[tuple[int, int, int], list[str]] = {}
    for p in split.to_read.layout.placements:
        spans.setdefault((p.region, p.offset, p.nbytes), []).append(p.name)

    def same(name: str) -> bool:
        a, b = mine[name], theirs.get(name)
        return b is not None and (a.checksum, a.dtype, list(a.shape)) == (b.checksum, b.dtype, list(b.shape))

    shared = [(span, names) for span, names in spans.items() if all(same(n) for n in names)]
    if not shared:
        return None, split
    taken = {n for _, names in shared for n in names}
    rest = [n for n in split.to_read.tensors if n not in taken]
    shared_bytes = sum(span[2] for span, _ in shared)
    from_other = Split(
        to_read=RankWeights.from_tensors(
            rank=split.to_read.rank, tensors={n: split.to_read.tensors[n] for n in taken}
        ),
        manifest=other.model_copy(update={"tensors": [t for t in other.tensors if t.name in taken]}),
        kept_bytes=0,
        read_bytes=shared_bytes,
    )
    remaining = Split(
        to_read=RankWeights.from_tensors(
            rank=split.to_read.rank, tensors={n: split.to_read.tensors[n] for n in rest}
        )
        if rest
        else None,
        manifest=split.manifest.model_copy(
            update={"tensors": [t for t in split.manifest.tensors if t.name in rest]}
        ),
        kept_bytes=split.kept_bytes,
        read_bytes=split.read_bytes - shared_bytes,
    )
    return from_other, remaining
