"""What reading one rank from one seed needs, decided once from its checked manifest and the destination.

Every reader (one-sided, staged, NCCL) takes a `ReadPlan` and nothing else of the pull: which seed
regions to read (their descriptors), what each destination tensor must digest to, which destination
byte spans are distinct (tied tensors share one and are read and digested once), and the zero-byte
tensors that move nothing. `accept` is the one place a digest is compared with the seed's (anchored)
one and recorded in the destination's `checksums`, which a seed this instance becomes publishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from backends import MemoryRegionDescriptor
from planner.contract import RankManifest
from rfork.errors import ChecksumMismatch, ConfigurationError, DestinationMismatch, PullError
from rfork.seed_networks import SeedNetworkRefused, check_engine_address
from rfork.weights import checksum as ck
from rfork.weights.rank_weights import RankWeights


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
    _remote: dict[int, MemoryRegionDescriptor] | None = field(default=None, repr=False)

    @classmethod
    def check(
        cls, manifest: RankManifest, dest: RankWeights, *, require_crypto_digest: bool = False
    ) -> ReadPlan:
        """The plan for reading `dest` from a seed's checked manifest, after the checks that must pass
        before any byte moves: names, dtypes and shapes (DestinationMismatch), and the digest algorithm
        (ConfigurationError where a cryptographic one is required, PullError where the seed's differs)."""
        check_destination(dest, manifest)
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

    @property
    def rank(self) -> int:
        return self.dest.rank

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct spans (overlapping spans count once each)."""
        return sum(s.nbytes for s in self.spans)

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

    def accept(self, names: Sequence[str], got: str) -> None:
        """Keep `got` as the digest of `names` (tensors sharing their bytes), or raise ChecksumMismatch
        naming the first whose published digest differs."""
        for name in names:
            if got != self.expected[name]:
                raise ChecksumMismatch(
                    f"tensor {name!r} of rank {self.rank}: checksum {got} != published {self.expected[name]}"
                )
            self.dest.checksums[name] = got

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


def check_destination(dest: RankWeights, manifest: RankManifest) -> None:
    """Names, dtypes and shapes of `dest` against a seed's manifest, before any byte moves.

    Raises DestinationMismatch naming the first bad tensor (manifest order, then extra names).
    """
    have = {p.name: p for p in dest.layout.placements}
    for t in manifest.tensors:
        p = have.get(t.name)
        if p is None:
            raise DestinationMismatch(
                f"rank {dest.rank}: tensor {t.name!r} is in the manifest but has no destination"
            )
        if p.dtype != t.dtype or tuple(p.shape) != tuple(t.shape):
            raise DestinationMismatch(
                f"rank {dest.rank}: tensor {t.name!r} is {t.dtype}{list(t.shape)} at the seed, "
                f"the destination {p.dtype}{list(p.shape)}"
            )
    published = {t.name for t in manifest.tensors}
    for p in dest.layout.placements:
        if p.name not in published:
            raise DestinationMismatch(
                f"rank {dest.rank}: destination tensor {p.name!r} is not in the manifest"
            )
