"""RankWeights: one global rank's tensors, the regions (address ranges) that hold them, their digests.

The one shape a seed serves and a loader fills. Two ways to make one: `from_tensors` takes tensors
where they already live (a framework's module: no copy, regions are the merged ranges covering
them), the checkpoint path owns flat region buffers with the tensors as views into them.
"""

from __future__ import annotations

import base64
import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from backends import DEFAULT_MAX_REGION_BYTES, Layout, Placement, dtype_name, plan_layout, shard_shape, views
from planner.contract import RankManifest, RegionEntry, TensorEntry, TensorStripes
from rfork.errors import ChecksumMismatch, LayoutError
from rfork.weights import checksum as ck
from rfork.weights.memory import allocate, pack
from rfork.weights.stripes import tensors_stripes


@dataclass(kw_only=True)
class RankWeights:
    """One global rank's weights and the address ranges (regions) that cover them.

    Two shapes, one interface: `from_tensors` serves tensors where they already live (no copy; the
    regions are the merged ranges covering them), while the checkpoint path owns flat region
    `buffers` with the tensors as views into them. `checksums` fills in lazily (compute_checksums).
    """

    rank: int
    layout: Layout
    tensors: dict[str, torch.Tensor]
    buffers: list[torch.Tensor] = field(default_factory=list)  # owned flat regions; [] when in place
    ranges: list[AddressRange] = field(default_factory=list)  # region i's memory; from buffers if empty
    checksums: dict[str, str] = field(default_factory=dict)
    # stripe digests of the split tensors (rfork.weights.stripes): published where `striped` is set (a
    # TP=1 checkpoint-layout identity, whose seeds serve any TP's shards), else only carried along
    stripes: dict[str, TensorStripes] = field(default_factory=dict)
    striped: bool = False
    # where the bytes came from: "disk" (a checkpoint, or the caller's own state dict) may anchor the
    # identity's digests at the planner; "peer" (pulled from another instance) never does
    origin: Literal["disk", "peer"] = "disk"

    def __post_init__(self) -> None:
        if not self.ranges:
            self.ranges = buffer_ranges(self.buffers)
        if len(self.ranges) != len(self.layout.region_sizes):
            raise ValueError(
                f"rank {self.rank}: {len(self.ranges)} address ranges "
                f"for {len(self.layout.region_sizes)} regions"
            )

    @classmethod
    def from_tensors(cls, *, rank: int = 0, tensors: Mapping[str, torch.Tensor]) -> RankWeights:
        """Serve `tensors` in place (a module's parameters and buffers, or a state dict): no copy.

        The regions are the merged address ranges covering the tensors (tied or shared storage
        once); the caller's tensors are kept as they are and must not change while served.
        """
        detached = {name: t.detach() for name, t in tensors.items()}
        layout, ranges = cover(detached)
        return cls(rank=rank, layout=layout, tensors=detached, ranges=ranges)

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, torch.Tensor],
        *,
        rank: int = 0,
        max_region_bytes: int = DEFAULT_MAX_REGION_BYTES,
    ) -> RankWeights:
        """Copy a state dict into fresh flat regions (prefer `from_tensors`, which copies nothing)."""
        layout, buffers, views = pack(
            {k: v.detach() for k, v in state_dict.items()}, max_region_bytes=max_region_bytes
        )
        return cls(rank=rank, layout=layout, buffers=buffers, tensors=views)

    @classmethod
    def allocate_for(cls, manifest: RankManifest) -> RankWeights:
        """Fresh flat region buffers (host memory on huge pages) for a seed's checked manifest.

        Sized from the tensor list (the anchored digests cover each tensor's dtype, shape and size),
        never from the seed's own region sizes: `RankManifest.check` refused a region larger than the
        tensors in it, or tensors that contradict their regions, before anything is allocated.
        """
        sizes = [0] * (max((r.index for r in manifest.regions), default=-1) + 1)
        for index, end in manifest.covered_region_bytes().items():
            sizes[index] = end
        layout = Layout(region_sizes=tuple(sizes), placements=tuple(placement(t) for t in manifest.tensors))
        buffers = allocate(layout)
        return cls(rank=manifest.rank, layout=layout, buffers=buffers, tensors=views(layout, buffers))

    @classmethod
    def allocate_shard(cls, manifest: RankManifest, *, tp: int, rank: int) -> RankWeights:
        """Fresh flat region buffers for TP rank `rank` of `tp`'s slice (backends.sharding) of a seed's
        checked manifest of whole tensors: what a rank reads its shard into."""
        layout = plan_layout(
            [(t.name, t.dtype, shard_shape(t.name, t.shape, tp, rank)) for t in manifest.tensors]
        )
        buffers = allocate(layout)
        return cls(rank=rank, layout=layout, buffers=buffers, tensors=views(layout, buffers))

    def holds(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether these weights are exactly `tensors` (same names, and each the same memory, dtype and
        shape): a module whose parameters were replaced since no longer is."""
        if self.tensors.keys() != tensors.keys():
            return False
        for name, t in tensors.items():
            mine = self.tensors[name]
            if mine.data_ptr() != t.data_ptr() or mine.dtype != t.dtype or mine.shape != t.shape:
                return False
        return True

    def verify(self, expected: Mapping[str, str]) -> None:
        """Digest every tensor named in `expected` where it is now and compare: ChecksumMismatch names the
        first that differs. (A pull checks as it reads, through its `rfork.pull.read_plan.ReadPlan`; this
        re-checks weights already verified, after a framework's post-load steps.)"""
        for name, want in expected.items():
            got = ck.tensor_checksum(self.tensors[name])
            if got != want:
                raise ChecksumMismatch(
                    f"tensor {name!r} of rank {self.rank}: checksum {got} != published {want}"
                )

    @property
    def device(self) -> torch.device:
        """Where the weights live (one rank, one device); cpu when there are none."""
        return torch.device(self.ranges[0].device) if self.ranges else torch.device("cpu")

    @property
    def checksum_algorithm(self) -> str:
        """The digest these weights are checked with (xxh3-128 on the host, pmix64 on a GPU)."""
        return ck.algorithm_for(self.device)

    def registrables(self) -> list[Any]:
        """What to hand `engine.register` per region: the flat buffer, else the covering range."""
        if self.buffers:
            return list(self.buffers)
        return [_range_target(r, self.tensors) for r in self.ranges]

    def host_mirrors(self) -> list[torch.Tensor]:
        """A host copy of each region (page-locked where CUDA exists): what a seed registers for GPU
        weights when its provider cannot register device memory. Costs host memory equal to the weights."""
        pinned = torch.cuda.is_available()
        mirrors = [torch.empty(r.nbytes, dtype=torch.uint8, pin_memory=pinned) for r in self.ranges]
        for p in self.layout.placements:
            if p.nbytes:
                flat = self.tensors[p.name].reshape(-1).view(torch.uint8)
                mirrors[p.region][p.offset : p.offset + p.nbytes].copy_(flat)
        return mirrors

    def compute_checksums(self) -> dict[str, str]:
        """Every tensor's digest (those already known, e.g. verified by a pull, are kept)."""
        for p in self.layout.placements:
            if p.name not in self.checksums:
                self.checksums[p.name] = ck.tensor_checksum(self.tensors[p.name])
        return self.checksums

    def compute_stripes(self) -> dict[str, TensorStripes]:
        """Every split tensor's stripe digests (those already known, e.g. from a verified pull, are kept)."""
        missing = {p.name: self.tensors[p.name] for p in self.layout.placements if p.name not in self.stripes}
        self.stripes.update(tensors_stripes(missing))
        return self.stripes

    def ordered_nonempty(self) -> list[torch.Tensor]:
        """Tensors in manifest order, zero-byte ones skipped (what the NCCL fallback streams)."""
        return [self.tensors[p.name] for p in self.layout.placements if p.nbytes]

    def manifest(self, descriptors: Sequence[bytes]) -> RankManifest:
        """The manifest a seed publishes: region i reached through descriptors[i], every tensor's digest,
        and where the bytes came from (`origin`)."""
        sums = self.compute_checksums()
        stripes = self.compute_stripes() if self.striped else {}
        return RankManifest(
            rank=self.rank,
            checksum_algorithm=self.checksum_algorithm,
            regions=[
                RegionEntry(index=i, nbytes=n, descriptor=base64.b64encode(descriptors[i]).decode("ascii"))
                for i, n in enumerate(self.layout.region_sizes)
            ],
            tensors=[entry(p, sums[p.name], stripes.get(p.name)) for p in self.layout.placements],
            origin="disk" if self.origin == "disk" else "peer",
        )


# The wire's tensor record (pydantic, validated where the planner receives it) and backends' (a frozen
# dataclass: backends imports neither pydantic models nor the planner) have the same fields but the
# checksum; rfork, which sees both layers, converts here and nowhere else.


def placement(t: TensorEntry) -> Placement:
    """A manifest's tensor as backends' record."""
    return Placement(
        name=t.name, dtype=t.dtype, shape=tuple(t.shape), nbytes=t.nbytes, region=t.region, offset=t.offset
    )


def entry(p: Placement, checksum: str, stripes: TensorStripes | None = None) -> TensorEntry:
    """Backends' record as a manifest's tensor, with its digest (and stripe digests, if any)."""
    return TensorEntry(
        name=p.name, dtype=p.dtype, shape=list(p.shape), nbytes=p.nbytes, region=p.region, offset=p.offset,
        checksum=checksum, stripes=stripes,
    )


def _range_target(r: AddressRange, tensors: Mapping[str, torch.Tensor]) -> Any:
    """engine.register's argument for a covering range: (ptr, nbytes) on the host; on a GPU the one
    tensor spanning it exactly when there is one (CUDA registration needs a tensor), else the range."""
    if r.device == "cpu":
        return (r.ptr, r.nbytes)
    for t in tensors.values():
        if t.numel() and int(t.data_ptr()) == r.ptr and t.numel() * t.element_size() == r.nbytes:
            return t
    return (r.ptr, r.nbytes)


@dataclass(frozen=True, kw_only=True)
class AddressRange:
    """A contiguous span of memory on one device that covers some tensors (what gets registered)."""

    ptr: int
    nbytes: int
    device: str  # "cpu", "cuda:0", ...


def cover(tensors: Mapping[str, torch.Tensor]) -> tuple[Layout, list[AddressRange]]:
    """In-place layout: the merged address ranges covering `tensors`, and each tensor's place in them.

    Nothing is copied. Spans that overlap or touch (on one device) merge into one range, so tied or
    shared storage counts once and neighbouring allocations register as one. Ranges are in address
    order; placements keep the mapping's order. Zero-byte tensors take no space (region 0, offset 0).
    Raises LayoutError naming the first tensor that is not contiguous or that lives on another device.
    """
    spans: list[tuple[str, int, int]] = []  # (device, start, end)
    placed: list[tuple[str, str, tuple[int, ...], int, int]] = []  # name, dtype, shape, ptr, nbytes
    device: str | None = None
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        shape = tuple(int(d) for d in t.shape)
        if nbytes == 0:
            placed.append((name, dtype_name(t.dtype), shape, 0, 0))
            continue
        if not t.is_contiguous():
            raise LayoutError(
                f"tensor {name!r} is not contiguous; serving or pulling in place needs contiguous tensors"
            )
        dev = str(t.device)
        if device is None:
            device = dev
        elif dev != device:
            raise LayoutError(f"tensor {name!r} is on {dev}, the others on {device}: one rank, one device")
        ptr = int(t.data_ptr())
        spans.append((dev, ptr, ptr + nbytes))
        placed.append((name, dtype_name(t.dtype), shape, ptr, nbytes))
    ranges: list[AddressRange] = []
    starts: list[int] = []
    for dev, start, end in sorted(spans):
        if ranges and start <= ranges[-1].ptr + ranges[-1].nbytes:
            last = ranges[-1]
            ranges[-1] = AddressRange(
                ptr=last.ptr, nbytes=max(end, last.ptr + last.nbytes) - last.ptr, device=dev
            )
            continue
        ranges.append(AddressRange(ptr=start, nbytes=end - start, device=dev))
        starts.append(start)
    placements: list[Placement] = []
    for name, dtype, shape, ptr, nbytes in placed:
        if nbytes == 0:
            placements.append(Placement(name=name, dtype=dtype, shape=shape, nbytes=0, region=0, offset=0))
            continue
        region = bisect.bisect_right(starts, ptr) - 1
        placements.append(
            Placement(
                name=name, dtype=dtype, shape=shape, nbytes=nbytes, region=region, offset=ptr - starts[region]
            )
        )
    return Layout(region_sizes=tuple(r.nbytes for r in ranges), placements=tuple(placements)), ranges


def buffer_ranges(buffers: Sequence[torch.Tensor]) -> list[AddressRange]:
    """The address range of each flat region buffer."""
    return [
        AddressRange(ptr=int(b.data_ptr()), nbytes=b.numel() * b.element_size(), device=str(b.device))
        for b in buffers
    ]
