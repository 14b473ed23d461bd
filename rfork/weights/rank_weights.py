"""RankWeights: one global rank's tensors, the regions (address ranges) that hold them, their digests.

The one shape a seed serves and a loader fills. Two ways to make one: `from_tensors` takes tensors
where they already live (a framework's module: no copy, regions are the merged ranges covering
them), the checkpoint path owns flat region buffers with the tensors as views into them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from backends.layout import DEFAULT_MAX_REGION_BYTES, Layout
from rfork.weights import checksum as ck
from rfork.weights.manifest import RankManifest, RegionEntry, TensorEntry
from rfork.weights.regions import AddressRange, buffer_ranges, cover, pack


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
    # where the bytes came from: "disk" (a checkpoint, or the caller's own state dict) may anchor the
    # identity's digests at the planner; "peer" (pulled from another instance) never does
    origin: str = "disk"

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

    @property
    def device(self) -> torch.device:
        """Where the weights live (one rank, one device); cpu when there are none."""
        return torch.device(self.ranges[0].device) if self.ranges else torch.device("cpu")

    @property
    def checksum_algorithm(self) -> str:
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
        for p in self.layout.placements:
            if p.name not in self.checksums:
                self.checksums[p.name] = ck.tensor_checksum(self.tensors[p.name])
        return self.checksums

    def ordered_nonempty(self) -> list[torch.Tensor]:
        """Tensors in manifest order, zero-byte ones skipped (what the NCCL fallback streams)."""
        return [self.tensors[p.name] for p in self.layout.placements if p.nbytes]

    def manifest(self, descriptors: Sequence[bytes]) -> RankManifest:
        sums = self.compute_checksums()
        regions = tuple(
            RegionEntry(index=i, nbytes=n, descriptor=descriptors[i])
            for i, n in enumerate(self.layout.region_sizes)
        )
        tensors = tuple(
            TensorEntry(
                name=p.name,
                dtype=p.dtype,
                shape=p.shape,
                nbytes=p.nbytes,
                region=p.region,
                offset=p.offset,
                checksum=sums[p.name],
            )
            for p in self.layout.placements
        )
        return RankManifest(
            rank=self.rank, checksum_algorithm=self.checksum_algorithm, regions=regions, tensors=tensors
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
