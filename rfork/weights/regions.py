"""A rank's regions in memory: flat buffers rfork allocates, or the address ranges covering tensors.

`backends.layout` decides where each tensor lies in the regions; this module makes the memory:
`allocate`/`pack` create flat region buffers (host ones on huge pages), `cover` finds the merged
address ranges that already hold a caller's tensors, so they can be served or filled in place.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from backends.layout import Layout, Placement, dtype_name, plan_layout, views
from rfork.errors import LayoutError
from rfork.weights.hostmem import empty_host_buffer


def layout_for(tensors: dict[str, torch.Tensor], **kwargs: int) -> Layout:
    """Plan for existing tensors, in their dict order."""
    return plan_layout([(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()], **kwargs)


def allocate(layout: Layout, *, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """One uninitialised flat uint8 buffer per region (host ones advised to use huge pages)."""
    if torch.device(device).type == "cpu":
        return [empty_host_buffer(n) for n in layout.region_sizes]
    return [torch.empty(n, dtype=torch.uint8, device=device) for n in layout.region_sizes]


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
