"""Same-host GPU-to-GPU transfers through CUDA IPC, with the TransferEngine's shape (provider "cuda-ipc").

The seed *exports* its weight regions: ``register(cuda_tensor, "read")``, and the region's descriptor
(backends.gpu.ipc_wire) carries an IPC handle of the allocation that holds the tensor. The loader
*opens* a descriptor once per region (cuIpcOpenMemHandle), then every ``read`` is one device copy on
the loader's own stream: the seed launches nothing and needs no progress thread. The CUDA calls sit
behind a backend (backends.gpu.ipc_backends: the driver through cuda-python by default, or torch's
storage sharing); this module is the logic, and its tests run it on CPU with a stand-in backend.

GPUs are named by UUID, not ordinal: the opener maps the exporter's GPU UUID to its own ordinal, so two
processes with different CUDA_VISIBLE_DEVICES agree. A region's export is taken only when its
descriptor is first asked for: a loader's local destination, never handed to a peer, is not exported.
Copies are ordered after the caller's work: ``read``/``write`` record an event on the caller's current
stream at submission, and the copy stream waits on it. After a read's future resolves, the bytes are
in place (its completion event was synchronised).

Lifetime: a descriptor is valid while its owner process lives and the region stays registered; the
seed must outlive every loader's reads (CUDA leaves a read of freed memory undefined). An open of a
handle whose owner has gone fails with ``PeerGone``, as does a local region deregistered meanwhile.
``close`` waits for queued copies, then unmaps what this engine opened.

Checks happen before any copy and raise the transport's error types: range and access
(RemoteAccessError), a descriptor from another host or a garbled one (TransferError), no CUDA
(BackendUnavailable). Within one process CUDA refuses to open its own handles, so a descriptor whose
owner is this process resolves through a process-local table instead.
Thread-safety: any thread may call register/read/write/deregister; copies are launched by one
private thread in submission order and completed (event synchronised) by another.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from backends.checks import check_local, check_remote
from backends.descriptor import ACCESS_NAMES
from backends.errors import EngineClosed, PeerUnreachable, TransferError
from backends.gpu.ipc_backends import Bytes, IpcBackend, Waitable, default_backend
from backends.gpu.ipc_wire import PROVIDER, CudaIpcDescriptor, IpcExport, as_ipc_descriptor, host_id

__all__ = ["PROVIDER", "CudaIpcDescriptor", "CudaIpcEngine", "IpcExport", "IpcRegion", "PeerGone", "host_id"]

log = logging.getLogger(__name__)


class PeerGone(PeerUnreachable):
    """The exporting process's region could not be opened or is no longer registered."""


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
        """Export on first use: a local-only region never pays for or exposes it."""
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

    device: the loader's CUDA device (its copy stream lives there). backend: "driver" or "torch"
    (default: backends.gpu.ipc_backends.default_backend), or an IpcBackend object (the tests' stand-in).
    """

    provider = PROVIDER

    def __init__(self, device: torch.device | str | int | None = None, *,
                 backend: IpcBackend | str | None = None) -> None:
        self._backend: IpcBackend = (backend if backend is not None and not isinstance(backend, str)
                                     else default_backend(device, backend))
        self.backend_name = str(getattr(self._backend, "name", "custom"))
        self.host = host_id()
        self.pid = os.getpid()
        self.address = f"{PROVIDER}:{self.host}:{self.pid}".encode()
        self._lock = threading.Lock()
        self._closed = False
        self._regions: set[IpcRegion] = set()
        self._opened: dict[tuple[int, int], Bytes] = {}
        self._launch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rfork-cuda-ipc-launch")
        self._complete = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rfork-cuda-ipc-done")
        self._ops = itertools.count()

    # ----- registration -------------------------------------------------------------------------
    def register(self, tensor: torch.Tensor, access: str = "rw") -> IpcRegion:
        """Take a contiguous tensor's bytes for the given remote access (exported when first asked)."""
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
                                 self._backend.device_uuid(region.device), self.backend_name
                                 if self.backend_name in ("torch", "driver") else "torch")

    def deregister(self, region: IpcRegion) -> None:
        """Stop serving a region; peers that opened it keep their mapping until they close."""
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
        rdesc = as_ipc_descriptor(remote_desc)
        check_local(self, region, offset, length, "read")
        self._check_remote(rdesc, remote_offset, length, "read")
        return self._submit("read", rdesc, lambda src: (region.data[offset:offset + length],
                                                        src[remote_offset:remote_offset + length]))

    def write(self, region: IpcRegion, offset: int, length: int, remote_desc: CudaIpcDescriptor | bytes,
              remote_offset: int) -> Future[None]:
        """Copy region[offset, +length) into remote [remote_offset, +length)."""
        rdesc = as_ipc_descriptor(remote_desc)
        check_local(self, region, offset, length, "write")
        self._check_remote(rdesc, remote_offset, length, "write")
        return self._submit("write", rdesc, lambda dst: (dst[remote_offset:remote_offset + length],
                                                         region.data[offset:offset + length]))

    # ----- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Finish launched copies, then drop this engine's exports and unmap what it opened."""
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

    def _remote_bytes(self, desc: CudaIpcDescriptor) -> Bytes:
        """The remote region's bytes: opened once per (pid, key), then cached (launch thread only)."""
        if desc.owner_pid == self.pid:
            with _LOCAL_LOCK:
                local = _LOCAL.get(desc.key)
            if local is None:
                raise PeerGone(f"region {desc.key:#x} of this process is no longer registered")
            return local.data
        ident = (desc.owner_pid, desc.key)
        cached = self._opened.get(ident)
        if cached is None:
            index = self._backend.local_index(desc.device_uuid)
            try:
                storage_bytes = self._backend.open(desc, index)
            except (RuntimeError, OSError) as exc:
                raise PeerGone(f"opening the CUDA IPC handle of pid {desc.owner_pid} failed: {exc}") from exc
            cached = storage_bytes[desc.region_offset:desc.region_offset + desc.length]
            self._opened[ident] = cached
        return cached

    def _submit(self, name: str, desc: CudaIpcDescriptor,
                pick: Callable[[Bytes], tuple[Bytes, Bytes]]) -> Future[None]:
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

        def launch(after: Any) -> None:
            try:
                dst, src = pick(self._remote_bytes(desc))
                handle = self._backend.copy(dst, src, after)
            except Exception as exc:  # noqa: BLE001 - surfaces through the future
                fail(exc)
                return
            self._complete.submit(wait, handle)

        with self._lock:
            self._check_open(name)
            after = self._backend.caller_event()  # on the submitting thread: its current stream
            self._launch.submit(launch, after)
        return fut
