"""Place a rank's tensors into a few large flat byte buffers ("regions"); tensors become views into them.

Few regions means few memory registrations (registration cost is per region, not per byte) and
large contiguous reads. Regions are capped (`max_region_bytes`) so a loader can register region
i+1 while region i is on the wire; a tensor larger than the cap gets a region of its own.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rfork.errors import LayoutError
from rfork.manifest import dtype_from_name, dtype_name, expected_nbytes

ALIGN = 64
DEFAULT_MAX_REGION_BYTES = 256 << 20


@dataclass(frozen=True, kw_only=True)
class Placement:
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


def layout_for(tensors: dict[str, torch.Tensor], **kwargs: int) -> Layout:
    """Plan for existing tensors, in their dict order."""
    return plan_layout([(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()], **kwargs)


def allocate(layout: Layout, *, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """One uninitialised flat uint8 buffer per region (host ones advised to use huge pages)."""
    if torch.device(device).type == "cpu":
        from rfork.hostmem import empty_host_buffer

        return [empty_host_buffer(n) for n in layout.region_sizes]
    return [torch.empty(n, dtype=torch.uint8, device=device) for n in layout.region_sizes]


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


def pack(
    tensors: dict[str, torch.Tensor],
    **kwargs: int,
) -> tuple[Layout, list[torch.Tensor], dict[str, torch.Tensor]]:
    """Copy tensors into freshly allocated regions; returns the layout, the buffers and the views."""
    layout = layout_for(tensors, **kwargs)
    device = next((t.device for t in tensors.values()), torch.device("cpu"))
    buffers = allocate(layout, device=device)
    placed = views(layout, buffers)
    for name, t in tensors.items():
        if t.numel():
            placed[name].copy_(t)
    return layout, buffers, placed


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
