"""KV-cache pages in GPU memory over the host KV protocol, staged through pinned host memory.

The pool's registered memory is a pinned host *mirror* with the exact geometry of the device pool,
so the protocol, its page spans, the ImmCounter and the channel's sealed frames are those of
`backends.kv` unchanged. The only additions are two copies per layer:

    prefill:  send_layer(l)  = copy layer l's K/V pages device -> mirror, then KvSender's send_layer(l)
    decode:   wait_layer(l)  = KvReceiver's wait_layer(l) (the layer's immediate counted), then copy
                               layer l's pages mirror -> device

so a page is in the mirror before its write is posted, and on the device before wait_layer returns.
Only the request's pages move between device and mirror: runs of consecutive page ids as slice
copies, scattered pages as one gather on the source side and one scatter on the destination side.
Nothing in `backends/kv` changes; these classes wrap `KvSender`, `KvReceiver` and their requests.

Thread-safety: as the wrapped classes; a request's layer is staged in at most once (a lock).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from backends.descriptor import MemoryRegionDescriptor
from backends.engine import TransferEngine
from backends.gpu.host_copy import page_runs, pinned_empty, synchronize
from backends.gpu.staging import byte_view
from backends.kv.pool import KvGeometry, KvPool
from backends.kv.receiver import IncomingRequest, KvReceiver
from backends.kv.sender import KvSender, OutgoingRequest

__all__ = ["DeviceIncoming", "DeviceKvPool", "DeviceKvReceiver", "DeviceKvSender", "DeviceOutgoing"]

SLICE_RUNS = 8  # up to this many runs of pages per layer half: slice copies; more: gather/scatter


def _scratch(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device, *,
             pinned: bool) -> torch.Tensor:
    pin = pinned and device.type == "cpu" and torch.cuda.is_available()
    return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)


class DeviceKvPool:
    """A paged KV pool in device memory, registered through a pinned host mirror of the same layout.

    device_buffer: contiguous tensor of exactly layers x 2 x pages x page_bytes bytes (any device;
    a CPU tensor stands in for the device in the tests). `pool` is the registered host KvPool.
    """

    def __init__(self, engine: TransferEngine, *, layers: int, pages: int, page_bytes: int,
                 device_buffer: torch.Tensor, access: str = "rw") -> None:
        geometry = KvGeometry(layers, pages, page_bytes)
        self.device = byte_view(device_buffer)
        if self.device.numel() != geometry.nbytes:
            raise ValueError(
                f"device buffer has {self.device.numel()} bytes, geometry needs {geometry.nbytes}"
            )
        self.mirror = pinned_empty(geometry.nbytes)
        self.pool = KvPool(engine, layers=layers, pages=pages, page_bytes=page_bytes, buffer=self.mirror,
                           access=access)
        self.geometry = geometry
        self.engine = engine

    @property
    def descriptor(self) -> MemoryRegionDescriptor:
        """The mirror's descriptor (what peers write into)."""
        return self.pool.descriptor

    def _layer(self, flat: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer's K and V halves as [2, pages, words]: 8-byte words where pages allow (torch's index
        kernels copy element by element, so uint8 elements are ~50x slower)."""
        g = self.geometry
        start = g.offset(layer, 0, 0)
        block = flat[start:start + 2 * g.pages * g.page_bytes]
        if g.page_bytes % 8 == 0 and start % 8 == 0:
            return block.view(torch.int64).view(2, g.pages, g.page_bytes // 8)
        return block.view(2, g.pages, g.page_bytes)

    def _copy_pages(self, dst: torch.Tensor, src: torch.Tensor, layer: int, pages: Sequence[int]) -> None:
        d, s = self._layer(dst, layer), self._layer(src, layer)
        runs = page_runs(pages)
        if len(runs) <= SLICE_RUNS:
            for first, n in runs:
                for half in (0, 1):  # contiguous on both sides: one DMA each
                    d[half, first:first + n].copy_(s[half, first:first + n], non_blocking=True)
        else:
            idx = torch.tensor(list(pages), dtype=torch.int64)
            shape = (2, len(idx), s.shape[2])
            # one gather per half where the bytes are (into pinned memory when that is the host side) ...
            picked = _scratch(shape, s.dtype, s.device, pinned=d.device.type == "cuda")
            s_idx = idx.to(s.device)
            for half in (0, 1):
                torch.index_select(s[half], 0, s_idx, out=picked[half])
            if picked.device != d.device:  # ... one contiguous copy across ...
                landed = _scratch(shape, s.dtype, d.device, pinned=s.device.type == "cuda")
                landed.copy_(picked, non_blocking=True)
                if d.device.type == "cpu":
                    synchronize(picked)  # the host scatter below reads what the DMA writes
                picked = landed
            d_idx = idx.to(d.device)
            for half in (0, 1):  # ... and one scatter per half where they go
                d[half].index_copy_(0, d_idx, picked[half])
        synchronize(d, s)

    def stage_out(self, layer: int, pages: Sequence[int]) -> None:
        """Copy layer's K and V pages device -> mirror; done on return."""
        self._copy_pages(self.mirror, self.device, layer, pages)

    def stage_in(self, layer: int, pages: Sequence[int]) -> None:
        """Copy layer's K and V pages mirror -> device; done on return."""
        self._copy_pages(self.device, self.mirror, layer, pages)

    def close(self) -> None:
        """Deregister the mirror."""
        self.pool.close()


class DeviceOutgoing:
    """A sender's request whose pages live on the device: each layer is staged out before it is sent."""

    def __init__(self, pool: DeviceKvPool, request: OutgoingRequest) -> None:
        self.pool = pool
        self.request = request
        self.request_id = request.request_id
        self.done: Future[None] = request.done
        self._staged: set[int] = set()
        self._lock = threading.Lock()

    def send_layer(self, layer: int) -> None:
        """Layer `layer` of the device pool holds this request's K and V (on the caller's stream)."""
        layers = self.pool.geometry.layers
        if not 0 <= layer < layers:
            raise ValueError(f"request {self.request_id}: layer {layer} is outside 0..{layers - 1}")
        with self._lock:
            if layer in self._staged:
                return
            self._staged.add(layer)
        self.pool.stage_out(layer, self.request.src_pages)
        self.request.send_layer(layer)

    def send_all(self) -> DeviceOutgoing:
        """Every layer is ready: stage and send them all."""
        for layer in range(self.pool.geometry.layers):
            self.send_layer(layer)
        return self

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until delivered (see OutgoingRequest.wait)."""
        self.request.wait(timeout_s)


class DeviceIncoming:
    """A receiver's request into device pages: a layer is on the device when wait_layer returns.

    `done` (the host request's future) says the bytes landed in the mirror; `wait` puts them all on
    the device.
    """

    def __init__(self, pool: DeviceKvPool, request: IncomingRequest) -> None:
        self.pool = pool
        self.request = request
        self.request_id = request.request_id
        self.pages = request.pages
        self.done: Future[None] = request.done
        self._staged: set[int] = set()
        self._lock = threading.Lock()

    def _stage(self, layer: int) -> None:
        with self._lock:
            if layer in self._staged:
                return
            self.pool.stage_in(layer, self.pages)
            self._staged.add(layer)

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """Block until layer `layer` landed and was copied to the device (or the request failed)."""
        self.request.wait_layer(layer, timeout_s)
        self._stage(layer)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every layer landed, then copy the layers not copied yet to the device."""
        self.request.wait(timeout_s)
        for layer in range(self.pool.geometry.layers):
            self._stage(layer)

    def cancel(self, reason: str = "cancelled") -> None:
        """Give up on this request (see IncomingRequest.cancel)."""
        self.request.cancel(reason)


class DeviceKvSender:
    """KvSender over a DeviceKvPool: `start` gives requests that stage each layer out before sending."""

    def __init__(self, pool: DeviceKvPool, **kwargs: Any) -> None:  # noqa: ANN401 - KvSender's options
        self.pool = pool
        self.sender = KvSender(pool.pool, **kwargs)
        self.engine = pool.engine

    @property
    def address(self) -> bytes:
        """What receivers join."""
        return self.sender.address

    def receivers(self) -> list[str]:
        """Labels of the receivers joined now."""
        return self.sender.receivers()

    def start(self, request_id: str, src_pages: Sequence[int]) -> DeviceOutgoing:
        """Begin a request whose K/V lives in src_pages of every layer of the device pool."""
        return DeviceOutgoing(self.pool, self.sender.start(request_id, src_pages))

    def close(self) -> None:
        """Close the sender's channel (pool and engine stay)."""
        self.sender.close()


class DeviceKvReceiver:
    """KvReceiver over a DeviceKvPool: `request` gives requests that copy each landed layer to the device."""

    def __init__(self, pool: DeviceKvPool, **kwargs: Any) -> None:  # noqa: ANN401 - KvReceiver's options
        self.pool = pool
        self.receiver = KvReceiver(pool.pool, **kwargs)
        self.engine = pool.engine

    def join(self, sender: bytes, timeout_s: float | None = None) -> None:
        """Introduce this pool to a sender (see KvReceiver.join)."""
        self.receiver.join(sender, timeout_s)

    def leave(self, sender: bytes) -> None:
        """Tell a sender this receiver is gone."""
        self.receiver.leave(sender)

    def request(self, sender: bytes, request_id: str, dst_pages: Sequence[int]) -> DeviceIncoming:
        """Ask `sender` for request_id's K/V into dst_pages of every layer of the device pool."""
        return DeviceIncoming(self.pool, self.receiver.request(sender, request_id, dst_pages))

    def close(self) -> None:
        """Close the receiver's channel (pool and engine stay)."""
        self.receiver.close()

