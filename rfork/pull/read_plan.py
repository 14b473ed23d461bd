"""What reading one rank from one seed needs, decided once from its checked manifest and the destination.

Every reader (one-sided, staged, NCCL) takes a `ReadPlan` and nothing else of the pull: which seed
regions to read (their descriptors), what each destination tensor must digest to, which destination
byte spans are distinct (tied tensors share one and are read and digested once), and the zero-byte
tensors that move nothing. `accept` is the one place a digest is compared with the seed's (anchored)
one and recorded in the destination's `checksums`, which a seed this instance becomes publishes.

A shard plan (`ReadPlan.check_shard`) reads one TP rank's slice of a seed's whole tensors: replicated
tensors whole, split ones as the whole stripes that make up the slice (rfork.weights.stripes), each
verified against its anchored stripe digest. A stripe along dim 0 is one contiguous span, digested as
it lands like any span; a slice along a later dim is a row of pieces per row of the tensor
(`Strided`), each stripe of it digested once every piece is read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from backends import MemoryRegionDescriptor, shard_shape, split_dim
from planner.contract import RankManifest, TensorEntry, TensorStripes
from rfork.errors import ChecksumMismatch, ConfigurationError, DestinationMismatch, PullError
from rfork.seed_networks import SeedNetworkRefused, check_engine_address
from rfork.weights import checksum as ck
from rfork.weights.rank_weights import RankWeights
from rfork.weights.stripes import StripeGrid, stripe_digests


@dataclass(frozen=True, slots=True)
class Span:
    """A distinct destination byte span, the tensors that are exactly it, and where the seed holds it."""

    region: int
    offset: int
    nbytes: int
    names: tuple[str, ...]
    src_region: int
    src_offset: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True, slots=True)
class Strided:
    """A split tensor's slice along a dim > 0 (the destination tensor, whole): `rows` pieces of `piece`
    bytes, `src_pitch` apart at the seed and back to back in the destination; its stripes (`names` in
    `ReadPlan.expected`, `width` each along `dim`) are digested once every piece is read."""

    tensor: str
    names: tuple[str, ...]
    dim: int
    width: int
    region: int
    offset: int
    src_region: int
    src_offset: int
    src_pitch: int
    rows: int
    piece: int

    @property
    def end(self) -> int:
        return self.offset + self.rows * self.piece


@dataclass(slots=True)
class Read:
    """One read: destination region/offset, source region/offset, length."""

    region: int
    offset: int
    src_region: int
    src_offset: int
    nbytes: int
    done: bool = False


@dataclass(eq=False)
class ReadPlan:
    """One rank's read from one seed (see the module docstring); build it with `ReadPlan.check`."""

    manifest: RankManifest
    dest: RankWeights
    spans: list[Span]  # in (region, offset) order
    empty: list[str]  # zero-byte tensors: nothing to read, digested as they are
    expected: dict[str, str]  # every tensor's digest at the seed (anchored: the manifest was checked)
    strided: list[Strided] = field(default_factory=list)  # a shard plan's stripes along dims > 0
    shard: tuple[int, int] | None = None  # (tp, rank) of a shard plan: the slice it reads
    _stripes_by_name: dict[str, TensorStripes] | None = field(default=None, repr=False)
    _remote: dict[int, MemoryRegionDescriptor] | None = field(default=None, repr=False)

    @classmethod
    def check(
        cls, manifest: RankManifest, dest: RankWeights, *, require_crypto_digest: bool = False
    ) -> ReadPlan:
        """The plan for reading `dest` from a seed's checked manifest, after the checks that must pass
        before any byte moves: names, dtypes and shapes (DestinationMismatch), and the digest algorithm
        (ConfigurationError where a cryptographic one is required, PullError where the seed's differs)."""
        check_destination(dest, manifest)
        _check_algorithm(manifest, dest, require_crypto_digest)
        src = {t.name: t for t in manifest.tensors}
        by_span: dict[tuple[int, int, int], list[str]] = {}
        empty: list[str] = []
        for p in dest.layout.placements:
            if p.nbytes:
                by_span.setdefault((p.region, p.offset, p.nbytes), []).append(p.name)
            else:
                empty.append(p.name)
        spans = []
        for (region, offset, nbytes), names in sorted(by_span.items()):
            # tied names are one span here; where the seed holds them apart, read the first it holds
            first = min((src[n] for n in names), key=lambda t: (t.region, t.offset))
            spans.append(Span(region, offset, nbytes, tuple(names), first.region, first.offset))
        return cls(
            manifest=manifest,
            dest=dest,
            spans=spans,
            empty=empty,
            expected={t.name: t.checksum for t in manifest.tensors},
        )

    @classmethod
    def check_shard(
        cls,
        manifest: RankManifest,
        dest: RankWeights,
        *,
        tp: int,
        rank: int,
        require_crypto_digest: bool = False,
    ) -> ReadPlan:
        """The plan for reading TP rank `rank` of `tp`'s slice (backends.sharding) of a seed's whole
        tensors into `dest`, which holds that slice's shapes. Before any byte moves: DestinationMismatch
        for a name, dtype or shape that is not the slice's; PullError for a split tensor whose stripes
        (the seed's, anchored) do not make up the slice, so that no byte goes unverified."""
        check_destination(dest, manifest, (tp, rank))
        _check_algorithm(manifest, dest, require_crypto_digest)
        placed = {p.name: p for p in dest.layout.placements}
        spans: list[Span] = []
        strided: list[Strided] = []
        empty: list[str] = []
        expected: dict[str, str] = {}
        _distinct(dest)
        for t in manifest.tensors:
            p = placed[t.name]
            if not p.nbytes:  # nothing to read; a slice that is empty of a tensor that is not: its own digest
                empty.append(t.name)
                expected[t.name] = t.checksum if not t.nbytes else ck.tensor_checksum(dest.tensors[t.name])
                continue
            if tuple(p.shape) == tuple(t.shape):  # replicated: the whole tensor, its own digest
                spans.append(Span(p.region, p.offset, p.nbytes, (t.name,), t.region, t.offset))
                expected[t.name] = t.checksum
                continue
            stripes, held = _stripes_of_slice(t, tp, rank, dest.rank)
            dim, size = stripes.dim, t.shape[stripes.dim]
            width = size // len(stripes.digests)
            inner = t.nbytes // math.prod(t.shape[: dim + 1])  # bytes per index of `dim`, per row
            rows = math.prod(t.shape[:dim])
            names = tuple(f"{t.name}#stripe{index}" for index in held)
            expected.update(zip(names, (stripes.digests[i] for i in held), strict=True))
            stripe_bytes = width * inner  # of one stripe in one row
            if rows == 1:  # each stripe a contiguous span at both ends: digested as it lands
                for local, (index, name) in enumerate(zip(held, names, strict=True)):
                    offset, src_offset = p.offset + local * stripe_bytes, t.offset + index * stripe_bytes
                    spans.append(Span(p.region, offset, stripe_bytes, (name,), t.region, src_offset))
                continue
            strided.append(
                Strided(
                    tensor=t.name, names=names, dim=dim, width=width, region=p.region, offset=p.offset,
                    src_region=t.region, src_offset=t.offset + held[0] * stripe_bytes, src_pitch=size * inner,
                    rows=rows, piece=len(held) * stripe_bytes,
                )
            )
        spans.sort(key=lambda s: (s.region, s.offset))
        return cls(
            manifest=manifest, dest=dest, spans=spans, empty=empty, expected=expected, strided=strided,
            shard=(tp, rank),
        )

    @property
    def rank(self) -> int:
        return self.dest.rank

    @property
    def nbytes(self) -> int:
        """Bytes it reads: the distinct spans (overlapping spans count once each) and strided stripes."""
        return sum(s.nbytes for s in self.spans) + sum(p.rows * p.piece for p in self.strided)

    def remote(self) -> dict[int, MemoryRegionDescriptor]:
        """The seed's region descriptors by region index (decoded once)."""
        if self._remote is None:
            self._remote = {
                r.index: MemoryRegionDescriptor.from_bytes(self.manifest.descriptor(r.index))
                for r in self.manifest.regions
            }
        return self._remote

    def check_addresses(self) -> None:
        """PullError unless every region descriptor's fabric address is inside RFORK_SEED_NETWORKS: the
        provider connects to the address a seed names (a tcp name is a socket address) at the first read."""
        for address in {d.address for d in self.remote().values()}:
            try:
                check_engine_address(address)
            except SeedNetworkRefused as exc:
                raise PullError(f"rank {self.rank}: {exc}") from exc

    def spans_by_region(self) -> list[list[Span]]:
        """The spans of each destination region, in offset order."""
        table: list[list[Span]] = [[] for _ in self.dest.layout.region_sizes]
        for span in self.spans:
            table[span.region].append(span)
        return table

    def reads(self, chunk_bytes: int) -> list[list[Read]]:
        """Reads per destination region, in address order, at most `chunk_bytes` each; bytes that several
        spans share (overlapping views) are read once."""
        if self.strided:
            return self._shard_reads(chunk_bytes)
        plan: list[list[Read]] = []
        for region, spans in enumerate(self.spans_by_region()):
            reads: list[Read] = []
            covered = 0
            for s in sorted(spans, key=lambda s: (s.offset, -s.nbytes, s.src_region, s.src_offset)):
                if s.end <= covered:
                    continue
                start = max(s.offset, covered)
                for lo in range(start, s.end, chunk_bytes):
                    n = min(chunk_bytes, s.end - lo)
                    reads.append(Read(region, lo, s.src_region, s.src_offset + (lo - s.offset), n))
                covered = s.end
            plan.append(reads)
        return plan

    def _shard_reads(self, chunk_bytes: int) -> list[list[Read]]:
        """`reads` of a shard plan: its spans (distinct) and each strided slice's row pieces, in order."""
        items: list[list[Span | Strided]] = [[] for _ in self.dest.layout.region_sizes]
        for span in self.spans:
            items[span.region].append(span)
        for strided in self.strided:
            items[strided.region].append(strided)
        plan: list[list[Read]] = []
        for region, inside in enumerate(items):
            reads: list[Read] = []
            for item in sorted(inside, key=lambda it: it.offset):
                if isinstance(item, Span):
                    for lo in range(item.offset, item.end, chunk_bytes):
                        n, src_offset = min(chunk_bytes, item.end - lo), item.src_offset + (lo - item.offset)
                        reads.append(Read(region, lo, item.src_region, src_offset, n))
                    continue
                for row in range(item.rows):
                    offset = item.offset + row * item.piece
                    src_offset = item.src_offset + row * item.src_pitch
                    for lo in range(0, item.piece, chunk_bytes):
                        n = min(chunk_bytes, item.piece - lo)
                        reads.append(Read(region, offset + lo, item.src_region, src_offset + lo, n))
            plan.append(reads)
        return plan

    def accept(self, names: Sequence[str], got: str) -> None:
        """Keep `got` as the digest of `names` (tensors sharing their bytes), or raise ChecksumMismatch
        naming the first whose published digest differs."""
        for name in names:
            if got != self.expected[name]:
                raise ChecksumMismatch(
                    f"tensor {name!r} of rank {self.rank}: checksum {got} != published {self.expected[name]}"
                )
            if name in self.dest.tensors:  # a stripe's digest is not its tensor's
                self.dest.checksums[name] = got
                stripes = self._stripes().get(name)
                if stripes is not None and self.shard is None:  # the whole tensor: its anchored stripes hold
                    self.dest.stripes[name] = stripes

    def _stripes(self) -> dict[str, TensorStripes]:
        if self._stripes_by_name is None:
            self._stripes_by_name = {t.name: t.stripes for t in self.manifest.tensors if t.stripes}
        return self._stripes_by_name

    def accept_strided(self) -> None:
        """Digest each stripe along a dim > 0 (gathered from its pieces, all read by now) and `accept` it."""
        names = [name for piece in self.strided for name in piece.names]
        parts = [
            self.dest.tensors[piece.tensor].narrow(piece.dim, local * piece.width, piece.width)
            for piece in self.strided
            for local in range(len(piece.names))
        ]
        for name, got in zip(names, stripe_digests(parts), strict=True):
            self.accept([name], got)

    def accept_span(self, span: Span) -> None:
        """Digest the span's bytes where they are now and `accept` them."""
        self.accept(span.names, ck.tensor_checksum(self.dest.tensors[span.names[0]]))

    def accept_empty(self) -> None:
        """The zero-byte tensors: nothing is read, their digest (of dtype and shape) is checked."""
        for name in self.empty:
            self.accept([name], ck.tensor_checksum(self.dest.tensors[name]))

    def accept_all(self) -> None:
        """Digest and check every tensor (a reader that cannot check as it reads: NCCL)."""
        self.accept_empty()
        for span in self.spans:
            self.accept_span(span)

    def streamed(self) -> list[torch.Tensor]:
        """The destination's tensors in manifest order, zero-byte ones skipped (what the NCCL fallback
        streams, the seed sending the same list)."""
        return [self.dest.tensors[t.name] for t in self.manifest.tensors if t.nbytes]


def _distinct(dest: RankWeights) -> None:
    """PullError where two destination tensors share bytes: a slice is read and verified per stripe, so a
    tensor that another one's reads overlap could be changed after it was verified."""
    placed = [(p.region, p.offset, p.offset + p.nbytes, p.name) for p in dest.layout.placements if p.nbytes]
    region, end, name = -1, 0, ""
    for p_region, start, p_end, p_name in sorted(placed):
        if p_region == region and start < end:
            raise PullError(
                f"rank {dest.rank}: tensors {name!r} and {p_name!r} share bytes; a shard is read into "
                "distinct tensors only"
            )
        if p_region != region or p_end > end:
            region, end, name = p_region, p_end, p_name


def _check_algorithm(manifest: RankManifest, dest: RankWeights, require_crypto_digest: bool) -> None:
    """ConfigurationError where a cryptographic digest is required and the destination's is not; PullError
    where the seed's algorithm is not the destination's."""
    algorithm = dest.checksum_algorithm
    if require_crypto_digest and not ck.is_cryptographic(algorithm):
        raise ConfigurationError(
            f"rank {dest.rank}: require_crypto_digest is set but {dest.device} tensors are digested with "
            f"{algorithm}, which is not cryptographic; set RFORK_DIGEST=blake3 on every "
            "seed and loader (and anchor the identity under blake3)",
            setting="require_crypto_digest",
        )
    if manifest.checksum_algorithm != algorithm:
        raise PullError(
            f"rank {dest.rank}: the seed's checksum algorithm {manifest.checksum_algorithm!r} "
            f"is not {algorithm!r} (the digest for {dest.device} tensors)"
        )


def _stripes_of_slice(t: TensorEntry, tp: int, rank: int, dest_rank: int) -> tuple[TensorStripes, range]:
    """The seed's stripes of split tensor `t` and those that make up TP rank `rank` of `tp`'s slice;
    PullError where they do not (no stripes, along another dim, or a count `tp` does not divide)."""
    stripes = t.stripes
    dim = split_dim(t.name, len(t.shape))
    held = None
    if stripes is not None and stripes.dim == dim:
        held = StripeGrid(stripes.dim, len(stripes.digests)).for_rank(tp, rank)
    if stripes is None or held is None:
        has = "none" if stripes is None else f"{len(stripes.digests)} along dim {stripes.dim}"
        raise PullError(
            f"rank {dest_rank}: tensor {t.name!r}: the seed publishes no stripes that make up rank {rank} of "
            f"TP={tp}'s slice (it has {has}), so that slice could not be verified"
        )
    return stripes, held


def check_destination(
    dest: RankWeights, manifest: RankManifest, shard: tuple[int, int] | None = None
) -> None:
    """Names, dtypes and shapes of `dest` against a seed's manifest (with `shard` = (tp, rank): against
    that TP rank's slice of its tensors), before any byte moves.

    Raises DestinationMismatch naming the first bad tensor (manifest order, then extra names).
    """
    have = {p.name: p for p in dest.layout.placements}
    for t in manifest.tensors:
        p = have.get(t.name)
        if p is None:
            raise DestinationMismatch(
                f"rank {dest.rank}: tensor {t.name!r} is in the manifest but has no destination"
            )
        want = tuple(t.shape) if shard is None else shard_shape(t.name, t.shape, *shard)
        if p.dtype != t.dtype or tuple(p.shape) != want:
            where = "at the seed" if shard is None else f"in rank {shard[1]} of TP={shard[0]}'s slice of it"
            raise DestinationMismatch(
                f"rank {dest.rank}: tensor {t.name!r} is {t.dtype}{list(want)} {where}, "
                f"the destination {p.dtype}{list(p.shape)}"
            )
    published = {t.name for t in manifest.tensors}
    for p in dest.layout.placements:
        if p.name not in published:
            raise DestinationMismatch(
                f"rank {dest.rank}: destination tensor {p.name!r} is not in the manifest"
            )
