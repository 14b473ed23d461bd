"""Same-host GPU-to-GPU transfers through CUDA IPC, with the TransferEngine's shape (provider "cuda-ipc").

The seed *exports* its weight regions: ``register(cuda_tensor, "read")`` takes a CUDA IPC handle of
the tensor's storage (PyTorch's ``UntypedStorage._share_cuda_``, i.e. cudaIpcGetMemHandle on the
caching allocator's block, plus torch's cross-process ref counter and event) and wraps it in a
serialisable ``CudaIpcDescriptor``. The loader *opens* a descriptor once
(``UntypedStorage._new_shared_cuda``, i.e. cudaIpcOpenMemHandle), then every ``read`` is a
``copy_`` on the loader's own CUDA stream: the seed launches nothing and needs no progress thread.

GPUs are named by UUID, not ordinal: the descriptor carries the exporter's GPU UUID and the opener
maps it to its own ordinal, so two processes with different CUDA_VISIBLE_DEVICES agree. A region's
IPC export (``_share_cuda_``) is taken only when its descriptor is first asked for: a loader's local
destination, never handed to a peer, is not exported. Copies are ordered after the caller's work:
``read``/``write`` record an event on the caller's current stream at submission, and the private
copy stream waits on it; opening a peer's handle (which may wait on the exporter's event) happens on
that copy stream too.

Checks happen before any copy and raise the transport's error types: range and access
(RemoteAccessError), a descriptor from another host or a garbled one (TransferError), no CUDA
(BackendUnavailable). Within one process CUDA refuses to open its own handles, so a descriptor whose
owner is this process resolves through a process-local table instead.

The CUDA calls sit behind ``IpcBackend`` so the engine logic is tested on CPU with a stand-in; the
real ``TorchCudaIpc`` backend is written to torch 2.x's IPC API and was not run on a GPU here.
Thread-safety: any thread may call register/read/write/deregister; copies are launched by one
private thread in submission order and completed (event synchronised) by another.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

from backends.descriptor import ACCESS_NAMES
from backends.engine import check_local, check_remote
from backends.errors import (
    BackendUnavailable,
    EngineClosed,
    PeerUnreachable,
    TransferError,
)

log = logging.getLogger(__name__)

PROVIDER = "cuda-ipc"
_MAGIC = b"RFCI"
_VERSION = 2  # 2: the exporter's GPU UUID travels with the descriptor
_HEAD = "<4sBBBxiqQQQQQQQ"  # magic, version, access, event_sync, device, pid, key, length, offsets...


def host_id() -> str:
    """Names this boot of this machine: CUDA IPC handles mean nothing anywhere else."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


class IpcExport(NamedTuple):
    """What PyTorch's _share_cuda_ returns for a storage, minus the device (kept separately)."""

    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True, slots=True)
class CudaIpcDescriptor:
    """A region exported over CUDA IPC: where it lives (host, pid, device), its handles, size and access.

    ``region_offset`` is the region's first byte inside the shared storage; ``length`` its size.
    ``key`` is a random 64-bit token naming the region within its owner process. ``device`` is the
    exporter's ordinal (informational: ordinals differ under CUDA_VISIBLE_DEVICES); ``device_uuid``
    names the GPU, and the opener maps it to its own ordinal.
    """

    host: str
    owner_pid: int
    key: int
    device: int
    access: str
    length: int
    region_offset: int
    ipc: IpcExport
    device_uuid: str = ""

    def __post_init__(self) -> None:
        if self.access not in ACCESS_NAMES:
            raise TransferError(f"descriptor access {self.access!r} is not one of {ACCESS_NAMES}")
        if self.length < 0 or self.region_offset < 0:
            raise TransferError("descriptor length and offset must be non-negative")

    @property
    def readable(self) -> bool:
        return self.access in ("read", "rw")

    @property
    def writable(self) -> bool:
        return self.access in ("write", "rw")

    @property
    def address(self) -> bytes:
        """The owner's address, in the sense of TransferEngine.address (host and pid)."""
        return f"{PROVIDER}:{self.host}:{self.owner_pid}".encode()

    def to_bytes(self) -> bytes:
        """Encode: fixed header, then the host name and the three handles, each length-prefixed."""
        x = self.ipc
        head = struct.pack(_HEAD, _MAGIC, _VERSION, ACCESS_NAMES.index(self.access),
                           int(x.event_sync_required), self.device, self.owner_pid, self.key, self.length,
                           self.region_offset,
                           x.storage_size, x.storage_offset, x.ref_counter_offset, 0)
        parts = [head]
        for blob in (self.host.encode(), x.handle, x.ref_counter_handle, x.event_handle,
                     self.device_uuid.encode()):
            parts += [struct.pack("<I", len(blob)), blob]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, blob: bytes) -> CudaIpcDescriptor:
        """Decode what to_bytes produced; TransferError on anything else."""
        def bad(why: str) -> TransferError:
            return TransferError(f"not an rfork CUDA IPC descriptor ({why})")

        try:
            (magic, version, access, sync, device, pid, key, length, roff, ssize, soff, rcoff,
             _reserved) = struct.unpack_from(_HEAD, blob, 0)
        except struct.error as exc:
            raise bad(str(exc)) from exc
        if magic != _MAGIC or version != _VERSION:
            raise bad("bad magic or version")
        pos = struct.calcsize(_HEAD)
        fields: list[bytes] = []
        for _ in range(5):
            if pos + 4 > len(blob):
                raise bad("truncated")
            (n,) = struct.unpack_from("<I", blob, pos)
            pos += 4
            if pos + n > len(blob):
                raise bad("truncated")
            fields.append(bytes(blob[pos:pos + n]))
            pos += n
        if pos != len(blob):
            raise bad("length mismatch")
        try:
            ipc = IpcExport(fields[1], ssize, soff, fields[2], rcoff, fields[3], bool(sync))
            return cls(fields[0].decode(), pid, key, device, ACCESS_NAMES[access], length, roff, ipc,
                       fields[4].decode())
        except (IndexError, UnicodeDecodeError) as exc:
            raise bad(str(exc)) from exc


class Waitable(Protocol):
    def synchronize(self) -> None:
        """Block until the copy behind this handle has completed."""


class IpcBackend(Protocol):
    """The CUDA-specific steps; TorchCudaIpc is the real one, tests use a CPU stand-in."""

    def check_tensor(self, tensor: torch.Tensor) -> int:
        """Validate a tensor to register; return its device index."""

    def device_uuid(self, index: int) -> str:
        """The UUID of this process's GPU `index` (stable across CUDA_VISIBLE_DEVICES)."""

    def local_index(self, uuid: str) -> int:
        """This process's ordinal of the GPU with `uuid`; TransferError when it is not visible here."""

    def export(self, tensor: torch.Tensor) -> IpcExport:
        """IPC handles for the storage holding tensor."""

    def caller_event(self) -> Any:
        """An event recorded now on the calling thread's current stream (None: nothing to wait for)."""

    def open(self, desc: CudaIpcDescriptor, index: int) -> torch.Tensor:
        """Open another process's export on local GPU `index`; a flat uint8 tensor of the whole storage."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Waitable:
        """Launch dst.copy_(src) on the loader's stream once `after` (a caller_event) has happened;
        the handle completes with the copy."""

    def close(self) -> None:
        """Release streams and anything else the backend holds."""


class _Event:
    def __init__(self, event: Any) -> None:
        self._event = event

    def synchronize(self) -> None:
        self._event.synchronize()


class TorchCudaIpc:
    """CUDA IPC through PyTorch's storage sharing (the same calls torch.multiprocessing uses)."""

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailable("CUDA IPC needs a CUDA device (torch.cuda.is_available() is false here)")
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type != "cuda":
            dev = torch.device("cuda", int(dev.index or 0))
        self.device = dev
        self.stream = torch.cuda.Stream(device=dev)
        count = torch.cuda.device_count()
        self._uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]

    def check_tensor(self, tensor: torch.Tensor) -> int:
        if tensor.device.type != "cuda":
            raise TransferError(f"cuda-ipc register: tensor is on {tensor.device}, not a CUDA device")
        return int(tensor.device.index or 0)

    def device_uuid(self, index: int) -> str:
        return self._uuids[index]

    def local_index(self, uuid: str) -> int:
        try:
            return self._uuids.index(uuid)
        except ValueError:
            raise TransferError(
                f"GPU {uuid or '(no UUID)'} is not visible in this process (CUDA_VISIBLE_DEVICES?)"
            ) from None

    def export(self, tensor: torch.Tensor) -> IpcExport:
        storage: Any = tensor.untyped_storage()
        (_dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = storage._share_cuda_()
        return IpcExport(bytes(handle), int(size), int(offset), bytes(rc_handle), int(rc_offset),
                         bytes(ev_handle or b""), bool(ev_sync))

    def caller_event(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def open(self, desc: CudaIpcDescriptor, index: int) -> torch.Tensor:
        x = desc.ipc
        torch.cuda._lazy_init()
        storage_cls: Any = torch.UntypedStorage
        # On the copy stream: _new_shared_cuda waits on the exporter's event on the current stream, and
        # the copies that read this storage run on the copy stream.
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            storage = storage_cls._new_shared_cuda(index, x.handle, x.storage_size, x.storage_offset,
                                                   x.ref_counter_handle, x.ref_counter_offset,
                                                   x.event_handle or None, x.event_sync_required)
        out = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
        return out.set_(storage, 0, (x.storage_size,), (1,))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Waitable:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)  # the caller's prior work on these tensors comes first
            dst.copy_(src, non_blocking=True)
            # the caching allocator must not hand these blocks out again before the copy is done
            dst.record_stream(self.stream)
            src.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _Event(event)

    def close(self) -> None:
        self.stream.synchronize()


class IpcRegion:
    """A registered tensor: its bytes, access and (exported on first use) the descriptor peers open."""

    def __init__(self, engine: CudaIpcEngine, tensor: torch.Tensor, data: torch.Tensor, access: str,
                 device: int) -> None:
        self.engine = engine
        self.tensor = tensor
        self.data = data  # flat uint8 view of the registered tensor
        self.nbytes = int(data.numel())
        self.access = access
        self.device = device
        self.key = secrets.randbits(63)
        self.closed = False
        self._descriptor: CudaIpcDescriptor | None = None
        self._export_lock = threading.Lock()

    @property
    def exported(self) -> bool:
        """Whether the IPC export was taken (only once the descriptor was asked for)."""
        return self._descriptor is not None

    @property
    def descriptor(self) -> CudaIpcDescriptor:
        """Export on first use (``_share_cuda_``): a local-only region never pays for or exposes it."""
        with self._export_lock:
            if self._descriptor is None:
                self._descriptor = self.engine._export(self)
            return self._descriptor

    def close(self) -> None:
        """Deregister (same as engine.deregister(region))."""
        self.engine.deregister(self)

    def __repr__(self) -> str:
        return f"IpcRegion(nbytes={self.nbytes}, access={self.access!r}, key={self.key:#x})"


# Regions registered by engines in this process, by key: CUDA cannot open a process's own handles.
_LOCAL: dict[int, IpcRegion] = {}
_LOCAL_LOCK = threading.Lock()
_E = TypeVar("_E", bound="CudaIpcEngine")


class CudaIpcEngine:
    """register / read / write / deregister / close, as TransferEngine, between GPUs of one host.

    device: the loader's CUDA device (its copy stream lives there). backend: for tests only.
    """

    provider = PROVIDER

    def __init__(self, device: torch.device | str | int | None = None, *,
                 backend: IpcBackend | None = None) -> None:
        self._backend: IpcBackend = backend if backend is not None else TorchCudaIpc(device)
        self.host = host_id()
        self.pid = os.getpid()
        self.address = f"{PROVIDER}:{self.host}:{self.pid}".encode()
        self._lock = threading.Lock()
        self._closed = False
        self._regions: set[IpcRegion] = set()
        self._opened: dict[tuple[int, int], torch.Tensor] = {}
        self._launch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rfork-cuda-ipc-launch")
        self._complete = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rfork-cuda-ipc-done")
        self._ops = itertools.count()

    # ----- registration -------------------------------------------------------------------------
    def register(self, tensor: torch.Tensor, access: str = "rw") -> IpcRegion:
        """Export a contiguous tensor's bytes for the given remote access."""
        if access not in ACCESS_NAMES:
            raise ValueError(f"access must be one of {ACCESS_NAMES}, not {access!r}")
        self._check_open("register")
        if not isinstance(tensor, torch.Tensor):
            raise TransferError(f"cuda-ipc register: {type(tensor).__name__} is not a torch tensor")
        device = self._backend.check_tensor(tensor)
        if not tensor.is_contiguous():
            raise TransferError("cuda-ipc register: tensor is not contiguous")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= 0:
            raise TransferError(f"cannot register an empty buffer ({nbytes} bytes)")
        data = tensor.reshape(-1).view(torch.uint8) if tensor.dtype != torch.uint8 else tensor.reshape(-1)
        region = IpcRegion(self, tensor, data, access, device)
        with self._lock:
            self._regions.add(region)
        with _LOCAL_LOCK:
            _LOCAL[region.key] = region
        return region

    def _export(self, region: IpcRegion) -> CudaIpcDescriptor:
        self._check_open("export")
        if region.closed:
            raise TransferError("export: region is deregistered")
        t = region.tensor
        return CudaIpcDescriptor(self.host, self.pid, region.key, region.device, region.access, region.nbytes,
                                 int(t.storage_offset()) * t.element_size(), self._backend.export(t),
                                 self._backend.device_uuid(region.device))

    def deregister(self, region: IpcRegion) -> None:
        """Stop serving a region; peers that opened it keep torch's reference until they close."""
        with self._lock:
            if region.closed:
                return
            region.closed = True
            self._regions.discard(region)
        with _LOCAL_LOCK:
            _LOCAL.pop(region.key, None)

    # ----- one-sided ops ------------------------------------------------------------------------
    def read(self, region: IpcRegion, offset: int, length: int, remote_desc: CudaIpcDescriptor | bytes,
             remote_offset: int) -> Future[None]:
        """Copy remote [remote_offset, +length) into region[offset, +length) on the loader's stream."""
        rdesc = _desc(remote_desc)
        check_local(self, region, offset, length, "read")
        self._check_remote(rdesc, remote_offset, length, "read")
        return self._submit("read", rdesc, lambda src: (region.data[offset:offset + length],
                                                        src[remote_offset:remote_offset + length]))

    def write(self, region: IpcRegion, offset: int, length: int, remote_desc: CudaIpcDescriptor | bytes,
              remote_offset: int) -> Future[None]:
        """Copy region[offset, +length) into remote [remote_offset, +length)."""
        rdesc = _desc(remote_desc)
        check_local(self, region, offset, length, "write")
        self._check_remote(rdesc, remote_offset, length, "write")
        return self._submit("write", rdesc, lambda dst: (dst[remote_offset:remote_offset + length],
                                                         region.data[offset:offset + length]))

    # ----- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Finish launched copies, drop opened peers' memory and this engine's exports."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            regions = list(self._regions)
        self._launch.shutdown(wait=True)
        self._complete.shutdown(wait=True)
        for r in regions:
            self.deregister(r)
        self._opened.clear()
        self._backend.close()

    def __enter__(self: _E) -> _E:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- internals ----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True once close() began."""
        return self._closed

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise EngineClosed(f"{what}: engine is closed")

    def _check_remote(self, desc: CudaIpcDescriptor, offset: int, length: int, op: str) -> None:
        """The engine's remote check (backends.engine.check_remote) plus CUDA IPC's own: same host,
        and the region inside its shared storage."""
        if desc.host != self.host:
            raise TransferError(f"{op}: descriptor is from host {desc.host!r}, this is {self.host!r}; "
                                "CUDA IPC only works between processes of one host")
        check_remote(desc, offset, length, op, need=op)
        if desc.region_offset + desc.length > desc.ipc.storage_size:
            raise TransferError(f"{op}: descriptor region [{desc.region_offset}, +{desc.length}) exceeds its "
                                f"{desc.ipc.storage_size}-byte storage")

    def _remote_bytes(self, desc: CudaIpcDescriptor) -> torch.Tensor:
        """The remote region's bytes as a local tensor: opened once per (pid, key), then cached."""
        if desc.owner_pid == self.pid:
            with _LOCAL_LOCK:
                local = _LOCAL.get(desc.key)
            if local is None:
                raise PeerGone(f"region {desc.key:#x} of this process is no longer registered")
            return local.data
        ident = (desc.owner_pid, desc.key)
        with self._lock:
            cached = self._opened.get(ident)
        if cached is None:
            index = self._backend.local_index(desc.device_uuid)
            try:
                storage_bytes = self._backend.open(desc, index)
            except (RuntimeError, OSError) as exc:
                raise PeerGone(f"opening the CUDA IPC handle of pid {desc.owner_pid} failed: {exc}") from exc
            cached = storage_bytes[desc.region_offset:desc.region_offset + desc.length]
            with self._lock:
                self._opened.setdefault(ident, cached)
        return cached

    def _submit(self, name: str, desc: CudaIpcDescriptor,
                pick: Any) -> Future[None]:
        fut: Future[None] = Future()
        fut.set_running_or_notify_cancel()
        peer = f"{PROVIDER}:pid {desc.owner_pid}"

        def fail(exc: BaseException) -> None:
            if isinstance(exc, TransferError):
                err: TransferError = type(exc)(f"{name} with peer {peer}: {exc}")
            else:
                err = TransferError(f"{name} with peer {peer} failed: {exc}")
            err.__cause__ = exc
            fut.set_exception(err)

        def wait(handle: Waitable) -> None:
            try:
                handle.synchronize()
            except Exception as exc:  # noqa: BLE001 - surfaces through the future
                fail(exc)
                return
            fut.set_result(None)

        def launch() -> None:
            try:
                dst, src = pick(self._remote_bytes(desc))
                handle = self._backend.copy(dst, src, after)
            except Exception as exc:  # noqa: BLE001 - surfaces through the future
                fail(exc)
                return
            self._complete.submit(wait, handle)

        after = self._backend.caller_event()  # on the submitting thread: its current stream
        with self._lock:
            self._check_open(name)
            self._launch.submit(launch)
        return fut


class PeerGone(PeerUnreachable):
    """The exporting process's region could not be opened or is no longer registered."""


def _desc(d: CudaIpcDescriptor | bytes) -> CudaIpcDescriptor:
    return d if isinstance(d, CudaIpcDescriptor) else CudaIpcDescriptor.from_bytes(d)
