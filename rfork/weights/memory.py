"""Memory for weights: flat region buffers rfork allocates itself, and faulting host pages in early.

`backends.layout` decides where each tensor lies in the regions; `allocate`/`pack` make the flat
buffers (host ones on transparent huge pages) and `prefault` faults fresh host pages in ahead of a
pull (rfork.pull.one_sided).

Weights are read by the kernel (socket receive, process_vm_readv) into memory that the loader or a
seed allocated. With 4 KiB pages each GiB is 262,144 page faults and as many page-table entries for
the kernel to walk on every copy; with 2 MiB pages it is 512. numpy advises huge pages for its large
arrays by default, torch does not, so rfork advises them for the flat buffers it allocates (never for
a caller's tensors: their memory policy is the caller's). Best effort: with THP off ("never") the
memory gets 4 KiB pages, as before.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from typing import Any

import torch

from backends import Layout, dtype_name, plan_layout, views

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23
_HUGE = 2 << 20
_PAGE = 4096
_ODD_BYTES = bytes(range(1, 256, 2))
_LIBC: list[Any] = []


def _libc() -> Any | None:
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


def empty_host_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised flat uint8 host tensor of `nbytes`, advised to use huge pages.

    Large ones are a fresh anonymous mapping of their own (kept alive by the tensor, unmapped when it
    goes): memory from the malloc heap may be faulted in already, in 4 KiB pages, before any advice.
    """
    if nbytes < _HUGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError) as exc:  # no THP on this kernel: 4 KiB pages, still correct
        log.debug("MADV_HUGEPAGE failed (%s); 4 KiB pages", exc)
    return torch.frombuffer(area, dtype=torch.uint8)


def resident(ptr: int, nbytes: int) -> bool:
    """Whether every host page of [ptr, +nbytes) is in memory already (mincore), so writing it faults
    nothing in. False when it cannot tell. About 1 ms per GiB, against 0.1-0.2 s for an
    MADV_POPULATE_WRITE of the same touched GiB (docs/benchmarks.md,
    "Pull pipeline: first touch, the demo's shm row, pre-faulting").

    A page that was only ever read (the shared zero page) counts as resident, though its first write
    still takes a fault: that is the fault `prefault` would have moved, not a wrong byte.
    """
    libc = _libc()
    if libc is None or nbytes <= 0:
        return False
    start = ptr - ptr % _PAGE
    pages = (ptr + nbytes - start + _PAGE - 1) // _PAGE
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * _PAGE), vec) != 0:
        return False
    # bit 0 of each byte: that page is resident (the other bits are undefined); deleting every byte
    # with bit 0 set leaves nothing iff all are
    return not bytes(vec).translate(None, _ODD_BYTES)


def prefault(ptr: int, nbytes: int) -> bool:
    """Fault in host pages [ptr, +nbytes) for writing without changing them (MADV_POPULATE_WRITE);
    True if it did, False if every page was resident already (`resident`) or it could not.

    Fresh memory otherwise takes its page faults inside the transport's kernel copy, one page at a
    time, which costs several times more (docs/benchmarks.md). Memory a framework initialised is
    resident already: populating it again walks every page through the fault path for nothing
    (0.1-0.2 s per GiB of 4 KiB pages), so it is checked first. Best effort: kernels before 5.14 (or
    memory that cannot be populated) are left as they are.
    """
    libc = _libc()
    if libc is None or nbytes <= 0 or resident(ptr, nbytes):
        return False
    start = ptr - ptr % _PAGE
    length = ptr + nbytes - start
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) != 0:
        log.debug("MADV_POPULATE_WRITE failed (errno %d); pages fault in during the pull", ctypes.get_errno())
        return False
    return True


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
