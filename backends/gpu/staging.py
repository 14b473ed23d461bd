"""Staging of CUDA tensors through pinned host bounce buffers, for providers without device memory (tcp).

A provider that cannot register GPU memory (tcp, shm; efa and verbs without FI_HMEM) still moves GPU
weights: the bytes go through a few registered host *bounce slots*. The pipeline is double-buffered
(``depth`` slots) so that the network fills one slot while the device copy drains another:

    read:   net read -> slot[i % depth] ; device copy slot -> dst      (receive, then copy)
    write:  device copy src -> slot[i % depth] ; net write slot -> peer  (copy, then send)

A slot is reused only after the step that consumes it has completed (the device copy's CUDA event
for reads, the network future for writes), so no byte is overwritten while still in use.

The pipeline is written against two small injectable steps (``NetStep``, ``DeviceStep``) so its
logic runs on CPU in the tests with CPU tensors standing in for device memory; ``StagedReader`` and
``StagedWriter`` bind those steps to the TransferEngine's public API and, where CUDA exists, to a
side CUDA stream. The side stream first waits on an event recorded on the caller's current stream
when the transfer was submitted (the caller's queued work on the tensor comes first); a read's
future resolves only after every device copy's event completed, so the bytes are in place then.

Thread-safety: each reader/writer owns its bounce slots and runs its pipelines one at a time on a
private thread; submit from any thread. Failure: the returned future fails with ``StagingError``
(a TransferError) naming the op, the chunk and how many bytes had already landed; every network op
still in flight is waited for before the future fails, so the bounce memory is quiet afterwards.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from backends.descriptor import MemoryRegionDescriptor
from backends.engine import Region, TransferEngine, as_descriptor, check_range, check_remote
from backends.errors import TransferError

log = logging.getLogger(__name__)

DEFAULT_BOUNCE_BYTES = 16 << 20
DEFAULT_DEPTH = 2
_WAIT_S = 600.0  # upper bound on one network chunk; the engine's own timeout_s fires long before


class StagingError(TransferError):
    """A staged transfer failed; ``bytes_done`` bytes of the destination (from its start) are complete."""

    def __init__(self, message: str, *, bytes_done: int) -> None:
        super().__init__(message)
        self.bytes_done = bytes_done


class Waitable(Protocol):
    """Something that completes later: a CUDA event, or an already-finished CPU copy."""

    def synchronize(self) -> None:
        """Block until the work behind this handle has completed."""


# Network side of the pipeline: (slot, n, remote_offset) -> future of moving n bytes between slot and peer.
NetStep = Callable[[int, int, int], "Future[None]"]
# Device side: (slot, n, offset) -> handle of copying n bytes between slot and the device tensor at offset.
DeviceStep = Callable[[int, int, int], Waitable]


class _Done:
    """A Waitable that is already complete (synchronous CPU copies)."""

    def synchronize(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class Chunk:
    """One pipeline step: ``length`` bytes at ``offset`` in the device tensor, ``remote_offset`` remotely."""

    index: int
    offset: int
    remote_offset: int
    length: int


def plan_chunks(offset: int, length: int, remote_offset: int, chunk_bytes: int) -> list[Chunk]:
    """Cut [offset, +length) into chunks of at most chunk_bytes (the last may be shorter; none if empty)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
    if offset < 0 or remote_offset < 0 or length < 0:
        raise ValueError(f"offsets and length must be non-negative ({offset}, {remote_offset}, {length})")
    return [Chunk(i, offset + k, remote_offset + k, min(chunk_bytes, length - k))
            for i, k in enumerate(range(0, length, chunk_bytes))]


def _wait_net(fut: Future[None]) -> BaseException | None:
    try:
        fut.result(_WAIT_S)
    except Exception as exc:  # noqa: BLE001 - every failure becomes the StagingError's cause
        return exc
    return None


def _drain(pending: Sequence[Future[None]]) -> None:
    """Wait for network ops still in flight (their errors are secondary to the first one)."""
    for fut in pending:
        if _wait_net(fut) is not None:
            log.debug("a further staged chunk failed while draining after the first error")


def run_read_pipeline(chunks: Sequence[Chunk], *, depth: int, fetch: NetStep, to_device: DeviceStep,
                      what: str = "staged read") -> int:
    """Receive-then-copy: network into slot i % depth, then device copy out of it. Returns bytes done.

    Up to ``depth`` network reads are in flight; a slot is refilled only once its device copy has
    completed. Raises StagingError (with the first failure as cause) after draining in-flight reads.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, not {depth}")
    copies: list[Waitable | None] = [None] * depth
    pending: deque[tuple[int, Chunk, Future[None]]] = deque()
    done = 0

    def fail(ch: Chunk, step: str, exc: BaseException) -> StagingError:
        _drain([f for _, _, f in pending])
        for c in copies:
            if c is not None:
                c.synchronize()
        return StagingError(
            f"{what}: {step} of chunk {ch.index} (bytes [{ch.offset}, {ch.offset + ch.length}) of the "
            f"destination, remote offset {ch.remote_offset}) failed after {done} bytes had landed: {exc}",
            bytes_done=done)

    def finish() -> None:
        nonlocal done
        slot, ch, fut = pending.popleft()
        exc = _wait_net(fut)
        if exc is not None:
            raise fail(ch, "network read", exc) from exc
        try:
            copies[slot] = to_device(slot, ch.length, ch.offset)
        except Exception as cexc:
            raise fail(ch, "device copy", cexc) from cexc
        done += ch.length  # counted once issued: the final synchronize below makes it true

    for ch in chunks:
        if len(pending) == depth:
            finish()
        slot = ch.index % depth
        prior = copies[slot]
        if prior is not None:
            prior.synchronize()  # the slot's previous bytes are on the device: safe to refill
            copies[slot] = None
        try:
            pending.append((slot, ch, fetch(slot, ch.length, ch.remote_offset)))
        except Exception as exc:
            raise fail(ch, "network read", exc) from exc
    while pending:
        finish()
    for c in copies:
        if c is not None:
            c.synchronize()
    return done


def run_write_pipeline(chunks: Sequence[Chunk], *, depth: int, from_device: DeviceStep, send: NetStep,
                       what: str = "staged write") -> int:
    """Copy-then-send: device copy into slot i % depth, then network write out of it. Returns bytes done.

    A slot is refilled only after its network write completed. Raises StagingError after draining.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, not {depth}")
    sends: list[tuple[Chunk, Future[None]] | None] = [None] * depth
    done = 0

    def fail(ch: Chunk, step: str, exc: BaseException) -> StagingError:
        _drain([s[1] for s in sends if s is not None])
        return StagingError(
            f"{what}: {step} of chunk {ch.index} (bytes [{ch.offset}, {ch.offset + ch.length}) of the "
            f"source, remote offset {ch.remote_offset}) failed after {done} bytes had been written: {exc}",
            bytes_done=done)

    def settle(slot: int) -> None:
        nonlocal done
        prior = sends[slot]
        if prior is None:
            return
        sends[slot] = None
        exc = _wait_net(prior[1])
        if exc is not None:
            raise fail(prior[0], "network write", exc) from exc
        done += prior[0].length

    for ch in chunks:
        slot = ch.index % depth
        settle(slot)
        try:
            from_device(slot, ch.length, ch.offset).synchronize()  # bytes must be in the slot before sending
        except Exception as exc:
            raise fail(ch, "device copy", exc) from exc
        try:
            sends[slot] = (ch, send(slot, ch.length, ch.remote_offset))
        except Exception as exc:
            raise fail(ch, "network write", exc) from exc
    order = sorted((s[0].index, i) for i, s in enumerate(sends) if s is not None)
    for _, slot in order:
        settle(slot)
    return done


# ---------------------------------------------------------------- binding to the engine and CUDA


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (no copy); contiguous tensors only."""
    if not tensor.is_contiguous():
        raise TransferError("staging: tensor is not contiguous")
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _pinned_bounce(nbytes: int) -> torch.Tensor:
    """Host memory for the bounce slots: page-locked when CUDA exists (async DMA), plain otherwise."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


class _Event:
    """Adapter: a recorded torch.cuda.Event as a Waitable."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def synchronize(self) -> None:
        self._event.synchronize()


_S = TypeVar("_S", bound="_Staged")


class _Staged:
    """Shared plumbing: the bounce region on the engine, a copy stream, a one-thread executor."""

    _access = "read"

    def __init__(self, engine: TransferEngine, *, bounce_bytes: int, depth: int,
                 device: torch.device | str | None, name: str) -> None:
        if bounce_bytes < 4096:
            raise ValueError(f"bounce_bytes must be >= 4096, not {bounce_bytes}")
        if depth < 1:
            raise ValueError(f"depth must be >= 1, not {depth}")
        self.engine = engine
        self.bounce_bytes = int(bounce_bytes)
        self.depth = int(depth)
        self._bounce = _pinned_bounce(self.bounce_bytes * self.depth)
        # Peers never need our bounce slots; "read" is the narrowest access the engine offers.
        self._region: Region = engine.register(self._bounce, self._access)
        self._stream: Any = None
        if device is not None and torch.device(device).type == "cuda":
            self._stream = torch.cuda.Stream(device=torch.device(device))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rfork-{name}")
        self._lock = threading.Lock()
        self._closed = False

    def _slot(self, slot: int, n: int) -> torch.Tensor:
        base = slot * self.bounce_bytes
        return self._bounce[base:base + n]

    def _caller_event(self, tensor: torch.Tensor) -> Any:
        """An event on the caller's current stream when `tensor` is on CUDA (None otherwise): the side
        stream waits on it, so the caller's queued work on the tensor (a fill, a zero_) comes first."""
        if self._stream is None or tensor.device.type != "cuda":
            return None
        if tensor.device != self._stream.device:
            raise TransferError(
                f"staging: tensor is on {tensor.device}, the copy stream on {self._stream.device}")
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return event

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Waitable:
        """dst.copy_(src) on the side stream (after `after`) when one side is on CUDA; else synchronous.

        torch's copy_ is the right call here (not the driver's): both sides are torch tensors, the host
        side is pinned so the copy is a true async DMA, and record_stream keeps the caching allocator
        from reusing the device block while the copy is queued."""
        if self._stream is None or (dst.device.type != "cuda" and src.device.type != "cuda"):
            dst.copy_(src)
            return _Done()
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            for t in (dst, src):
                if t.device.type == "cuda":
                    t.record_stream(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        return _Event(event)

    def _submit(self, fn: Callable[[], int]) -> Future[int]:
        with self._lock:
            if self._closed:
                raise TransferError("staging: closed")
            return self._pool.submit(fn)

    def close(self) -> None:
        """Finish queued transfers, then deregister the bounce slots."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        self.engine.deregister(self._region)

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StagedReader(_Staged):
    """Pull remote bytes into a (CUDA) tensor through ``depth`` registered host slots of ``bounce_bytes``.

    ``device`` picks the CUDA device for the copy stream (default: cuda:0 when CUDA exists); with CPU
    destinations the device copy is a plain synchronous copy_.
    """

    def __init__(self, engine: TransferEngine, *, bounce_bytes: int = DEFAULT_BOUNCE_BYTES,
                 depth: int = DEFAULT_DEPTH, device: torch.device | str | None = None) -> None:
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(engine, bounce_bytes=bounce_bytes, depth=depth, device=device, name="staged-read")

    def read_into(self, dst: torch.Tensor, dst_offset: int, length: int,
                  remote_desc: MemoryRegionDescriptor | bytes, remote_offset: int) -> Future[int]:
        """Read remote [remote_offset, +length) into dst's bytes [dst_offset, +length); future of bytes read.

        Range errors (local or remote, or access) raise here before any byte moves.
        """
        view = byte_view(dst)
        check_range("staged read", "destination", dst_offset, length, view.numel(), "tensor")
        check_remote(as_descriptor(remote_desc), remote_offset, length, "staged read", need="read")
        chunks = plan_chunks(dst_offset, length, remote_offset, self.bounce_bytes)
        after = self._caller_event(view)

        def fetch(slot: int, n: int, roff: int) -> Future[None]:
            return self.engine.read(self._region, slot * self.bounce_bytes, n, remote_desc, roff)

        def to_device(slot: int, n: int, off: int) -> Waitable:
            return self._copy(view[off:off + n], self._slot(slot, n), after)

        return self._submit(lambda: run_read_pipeline(
            chunks, depth=self.depth, fetch=fetch, to_device=to_device,
            what=f"staged read of {length} bytes"))


class StagedWriter(_Staged):
    """Push a (CUDA) tensor's bytes to a remote region through ``depth`` registered host slots."""

    def __init__(self, engine: TransferEngine, *, bounce_bytes: int = DEFAULT_BOUNCE_BYTES,
                 depth: int = DEFAULT_DEPTH, device: torch.device | str | None = None) -> None:
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(engine, bounce_bytes=bounce_bytes, depth=depth, device=device, name="staged-write")

    def write_from(self, src: torch.Tensor, src_offset: int, length: int,
                   remote_desc: MemoryRegionDescriptor | bytes, remote_offset: int) -> Future[int]:
        """Write src's bytes [src_offset, +length) to remote [remote_offset, +length); future of bytes sent.

        Range errors (local or remote, or access) raise here before any byte moves.
        """
        view = byte_view(src)
        check_range("staged write", "source", src_offset, length, view.numel(), "tensor")
        check_remote(as_descriptor(remote_desc), remote_offset, length, "staged write", need="write")
        chunks = plan_chunks(src_offset, length, remote_offset, self.bounce_bytes)
        after = self._caller_event(view)

        def from_device(slot: int, n: int, off: int) -> Waitable:
            return self._copy(self._slot(slot, n), view[off:off + n], after)

        def send(slot: int, n: int, roff: int) -> Future[None]:
            return self.engine.write(self._region, slot * self.bounce_bytes, n, remote_desc, roff)

        return self._submit(lambda: run_write_pipeline(
            chunks, depth=self.depth, from_device=from_device, send=send,
            what=f"staged write of {length} bytes"))


def host_mirror(tensor: torch.Tensor) -> torch.Tensor:
    """A page-locked host copy of a device tensor, for a seed that serves CUDA weights over tcp.

    One-sided reads cannot make the passive side launch a device copy, so a tcp seed registers this
    mirror (costing host memory equal to its weights) instead of the GPU tensor.
    """
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
    out.copy_(tensor)
    return out
