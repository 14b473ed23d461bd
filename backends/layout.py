"""Where a rank's tensors lie in a few large flat byte buffers ("regions"): the placement rule.

Few regions means few memory registrations (registration cost is per region, not per byte) and
large contiguous transfers. Regions are capped (`max_region_bytes`) so a loader can register
region i+1 while region i is on the wire; a tensor larger than the cap gets a region of its own.
The rule is a pure function of (names, dtypes, shapes, cap), so peers that agree on those agree on
every offset without exchanging them (the RL path relies on it). Pure torch, no transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGN = 64
DEFAULT_MAX_REGION_BYTES = 256 << 20


def dtype_from_name(name: str) -> torch.dtype:
    """torch dtype for a dtype name as manifests write it ("bfloat16", ...); ValueError if unknown."""
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")  # noqa: TRY004 - a bad name is a bad value
    return dt


def dtype_name(dtype: torch.dtype) -> str:
    """The name manifests use for a torch dtype ("bfloat16")."""
    return str(dtype).removeprefix("torch.")


def expected_nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Bytes of a contiguous tensor of this dtype and shape."""
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, kw_only=True)
class Placement:
    """One tensor: its name, dtype ("bfloat16"), shape, and where its `nbytes` lie: at `offset` of byte
    container `region` (a rank's region; for a checkpoint on disk, one of its files).

    The tensor record of backends and rfork; the planner's wire carries the same fields plus the
    checksum (planner.wire.TensorEntry; rfork.weights.rank_weights converts, in one place)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    region: int
    offset: int


@dataclass(frozen=True, kw_only=True)
class Layout:
    region_sizes: tuple[int, ...]
    placements: tuple[Placement, ...]

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.placements)


def plan_layout(
    specs: Sequence[tuple[str, str, Sequence[int]]],
    *,
    max_region_bytes: int = DEFAULT_MAX_REGION_BYTES,
    align: int = ALIGN,
) -> Layout:
    """Greedy packing in the given order; zero-byte tensors get region 0, offset 0 and take no space."""
    if max_region_bytes <= 0 or align <= 0:
        raise ValueError("max_region_bytes and align must be positive")
    sizes: list[int] = []
    placements: list[Placement] = []
    for name, dtype, shape in specs:
        nbytes = expected_nbytes(dtype_from_name(dtype), shape)
        if nbytes == 0:
            placements.append(
                Placement(name=name, dtype=dtype, shape=tuple(shape), nbytes=0, region=0, offset=0)
            )
            continue
        if not sizes:
            sizes.append(0)
        offset = -(-sizes[-1] // align) * align
        if sizes[-1] and offset + nbytes > max_region_bytes:
            sizes.append(0)
            offset = 0
        sizes[-1] = offset + nbytes
        placements.append(
            Placement(
                name=name,
                dtype=dtype,
                shape=tuple(int(d) for d in shape),
                nbytes=nbytes,
                region=len(sizes) - 1,
                offset=offset,
            )
        )
    return Layout(region_sizes=tuple(sizes), placements=tuple(placements))


def views(layout: Layout, buffers: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Typed, shaped views of each placement into the region buffers (zero-byte tensors: fresh empties)."""
    out: dict[str, torch.Tensor] = {}
    for p in layout.placements:
        dt = dtype_from_name(p.dtype)
        if p.nbytes == 0:
            out[p.name] = torch.empty(p.shape, dtype=dt, device=buffers[0].device if buffers else "cpu")
            continue
        raw = buffers[p.region][p.offset : p.offset + p.nbytes]
        out[p.name] = raw.view(dt).view(p.shape)
    return out


