"""The CUDA side of the cuda-ipc provider: export a tensor's storage, open a peer's, copy on a stream.

Two backends with one shape (``IpcBackend``); the engine (backends.gpu.cuda_ipc) holds the logic.

``DriverCudaIpc`` (the default where cuda-python imports) speaks to the driver (backends.gpu.driver):
the export names the whole allocation holding the tensor (``cuMemGetAddressRange``,
``cuIpcGetMemHandle``), the exporter synchronises its stream first so the bytes are there; an open
maps it (``cuIpcOpenMemHandle``) and the mapping is raw device memory (``DeviceSpan``); a copy is
``cuMemcpyDtoDAsync`` on the engine's stream after a driver event recorded on the caller's current
stream, and completes with an event. It opens torch's exports too (same handle of the same base).

``TorchCudaIpc`` uses torch's storage sharing (``_share_cuda_`` / ``_new_shared_cuda``, what
torch.multiprocessing does), with torch's cross-process ref counter and event; kept as the second
path (and for exporters that want torch's ref counting), and for machines without cuda-python.

Torch's API is kept, in both, for what torch owns: which stream the caller's work is on
(``torch.cuda.current_stream``), the copy stream's allocator bookkeeping (``record_stream``, so the
caching allocator cannot hand a destination block out again while a copy into it is queued), and the
GPU's UUID (``get_device_properties``), so that both backends name a GPU the same way.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

from backends.errors import BackendUnavailable, TransferError
from backends.gpu.driver import Driver, DriverError, available, shared_driver
from backends.gpu.ipc_wire import CudaIpcDescriptor, IpcExport

BACKEND_ENV = "RFORK_CUDA_IPC"  # "driver" or "torch"; default: driver where cuda-python imports


class DeviceSpan:
    """Bytes [ptr, +nbytes) of device memory torch does not own (an opened peer allocation).

    Slices like a flat uint8 tensor (step 1 only); ``owner`` keeps the mapping it came from alive."""

    __slots__ = ("nbytes", "owner", "ptr")

    def __init__(self, ptr: int, nbytes: int, owner: object = None) -> None:
        self.ptr, self.nbytes, self.owner = int(ptr), int(nbytes), owner

    def numel(self) -> int:
        return self.nbytes

    def data_ptr(self) -> int:
        return self.ptr

    def __getitem__(self, s: slice) -> DeviceSpan:
        start, stop, step = s.indices(self.nbytes)
        if step != 1:
            raise ValueError("DeviceSpan slices take step 1")
        return DeviceSpan(self.ptr + start, max(stop - start, 0), self.owner)

    def __repr__(self) -> str:
        return f"DeviceSpan(ptr={self.ptr:#x}, nbytes={self.nbytes})"


Bytes = torch.Tensor | DeviceSpan


class Waitable(Protocol):
    def synchronize(self) -> None:
        """Block until the copy behind this handle has completed."""


class IpcBackend(Protocol):
    """The CUDA-specific steps; the tests run the engine with a CPU stand-in."""

    name: str

    def check_tensor(self, tensor: torch.Tensor) -> int:
        """Validate a tensor to register; return its device index."""

    def device_uuid(self, index: int) -> str:
        """The UUID of this process's GPU `index` (stable across CUDA_VISIBLE_DEVICES)."""

    def local_index(self, uuid: str) -> int:
        """This process's ordinal of the GPU with `uuid`; TransferError when it is not visible here."""

    def export(self, tensor: torch.Tensor) -> IpcExport:
        """IPC handles for the storage holding tensor (its bytes written so far are visible to openers)."""

    def caller_event(self) -> Any:
        """An event recorded now on the calling thread's current stream (None: nothing to wait for)."""

    def open(self, desc: CudaIpcDescriptor, index: int) -> Bytes:
        """Open another process's export on local GPU `index`: the whole shared storage, flat bytes."""

    def copy(self, dst: Bytes, src: Bytes, after: Any) -> Waitable:
        """Queue dst <- src (same length) on the engine's stream once `after` (a caller_event) has
        happened; the handle completes with the copy."""

    def close(self) -> None:
        """Wait for queued copies, then release streams and opened mappings."""


def _uuids() -> list[str]:
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def _cuda_device(device: torch.device | str | int | None) -> torch.device:
    if not torch.cuda.is_available():
        raise BackendUnavailable("CUDA IPC needs a CUDA device (torch.cuda.is_available() is false here)")
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return dev if dev.type == "cuda" and dev.index is not None else torch.device("cuda", int(dev.index or 0))


def _check_cuda_tensor(tensor: torch.Tensor) -> int:
    if tensor.device.type != "cuda":
        raise TransferError(f"cuda-ipc register: tensor is on {tensor.device}, not a CUDA device")
    return int(tensor.device.index or 0)


def _local_index(uuids: list[str], uuid: str) -> int:
    try:
        return uuids.index(uuid)
    except ValueError:
        raise TransferError(
            f"GPU {uuid or '(no UUID)'} is not visible in this process (CUDA_VISIBLE_DEVICES?)"
        ) from None


class _TorchEvent:
    def __init__(self, event: Any) -> None:
        self._event = event

    def synchronize(self) -> None:
        self._event.synchronize()


class TorchCudaIpc:
    """CUDA IPC through PyTorch's storage sharing (the calls torch.multiprocessing makes)."""

    name = "torch"

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        self.device = _cuda_device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self._uuids = _uuids()

    def check_tensor(self, tensor: torch.Tensor) -> int:
        return _check_cuda_tensor(tensor)

    def device_uuid(self, index: int) -> str:
        return self._uuids[index]

    def local_index(self, uuid: str) -> int:
        return _local_index(self._uuids, uuid)

    def export(self, tensor: torch.Tensor) -> IpcExport:
        storage: Any = tensor.untyped_storage()
        (_dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = storage._share_cuda_()
        return IpcExport(bytes(handle), int(size), int(offset), bytes(rc_handle), int(rc_offset),
                         bytes(ev_handle or b""), bool(ev_sync))

    def caller_event(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def open(self, desc: CudaIpcDescriptor, index: int) -> Bytes:
        x = desc.ipc
        if not x.ref_counter_handle:
            raise TransferError(f"a {desc.exporter} export carries no torch ref counter: open it with "
                                f"{BACKEND_ENV}=driver")
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

    def copy(self, dst: Bytes, src: Bytes, after: Any) -> Waitable:
        if not isinstance(dst, torch.Tensor) or not isinstance(src, torch.Tensor):
            raise TransferError("the torch backend copies between tensors only")
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)  # the caller's prior work on these tensors comes first
            dst.copy_(src, non_blocking=True)
            # the caching allocator must not hand these blocks out again before the copy is done
            dst.record_stream(self.stream)
            src.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _TorchEvent(event)

    def close(self) -> None:
        self.stream.synchronize()


class _DriverEvent:
    """A driver event that completes a copy; released once waited for."""

    def __init__(self, driver: Driver, device: int, event: Any) -> None:
        self._driver, self._device, self._event = driver, device, event

    def synchronize(self) -> None:
        event, self._event = self._event, None
        if event is None:
            return
        with self._driver.on(self._device):
            try:
                self._driver.event_synchronize(event)
            finally:
                self._driver.event_destroy(event)


class _Mapping:
    """One cuIpcOpenMemHandle of a peer allocation, closed once (by the backend's close)."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.closed = False


class DriverCudaIpc:
    """CUDA IPC through the driver API (cuda-python); see the module docstring.

    ``driver``: a Driver (tests pass one over a CPU fake; then ``uuids`` names its GPUs, the stream is a
    driver stream, and CPU tensors stand in for device memory). Thread-safe.
    """

    name = "driver"

    def __init__(self, device: torch.device | str | int | None = None, *, driver: Driver | None = None,
                 uuids: list[str] | None = None) -> None:
        self._real = driver is None
        if self._real:
            self.device = _cuda_device(device)
            try:
                self.driver = shared_driver()
            except ImportError as exc:
                raise BackendUnavailable(f"the cuda-ipc driver backend needs cuda-python: {exc}") from exc
            except Exception as exc:  # noqa: BLE001 - cuda-python raises its own types without a driver
                raise BackendUnavailable(f"the CUDA driver did not start: {exc}") from exc
            self._uuids = _uuids()
            self._torch_stream: Any = torch.cuda.Stream(device=self.device)
            self.stream = int(self._torch_stream.cuda_stream)
        else:
            assert driver is not None
            self.device = torch.device("cpu") if device is None else torch.device(device)
            self.driver = driver
            self._uuids = list(uuids or ["GPU-fake-0"])
            self._torch_stream = None
            with driver.on(self.index):
                self.stream = driver.stream_create()
        self._lock = threading.Lock()
        self._mappings: list[_Mapping] = []

    @property
    def index(self) -> int:
        return int(self.device.index or 0)

    def check_tensor(self, tensor: torch.Tensor) -> int:
        if not self._real:
            return 0
        return _check_cuda_tensor(tensor)

    def device_uuid(self, index: int) -> str:
        return self._uuids[index]

    def local_index(self, uuid: str) -> int:
        return _local_index(self._uuids, uuid)

    def export(self, tensor: torch.Tensor) -> IpcExport:
        storage = tensor.untyped_storage()
        sptr, snbytes = int(storage.data_ptr()), int(storage.nbytes())
        index = int(tensor.device.index or 0) if self._real else self.index
        if self._real:
            # an opener sees the bytes as they are when it copies: whatever this process queued that
            # writes them (on any stream) must be done; an export is taken once per region
            torch.cuda.synchronize(tensor.device)
        with self.driver.on(index):
            base, size = self.driver.address_range(sptr)
            if not (base <= sptr and sptr + snbytes <= base + size):
                raise TransferError(f"storage [{sptr:#x}, +{snbytes}) is not inside its allocation "
                                    f"[{base:#x}, +{size})")
            handle = self.driver.ipc_handle(base)
        return IpcExport(handle, snbytes, sptr - base, b"", 0, b"", False)

    def caller_event(self) -> Any:
        current = int(torch.cuda.current_stream(self.device).cuda_stream) if self._real else 0
        with self.driver.on(self.index):
            return self.driver.event_record(current)

    def open(self, desc: CudaIpcDescriptor, index: int) -> Bytes:
        x = desc.ipc
        if desc.exporter != "driver":  # torch's handle string is torch's own format (66 bytes on 2.11)
            raise TransferError(f"a {desc.exporter} export is opened by that backend: open it with "
                                f"CudaIpcEngine(backend={desc.exporter!r})")
        with self.driver.on(index):
            base = self.driver.ipc_open(x.handle)
        mapping = _Mapping(base)
        with self._lock:
            self._mappings.append(mapping)
        return DeviceSpan(base + x.storage_offset, x.storage_size, mapping)

    def copy(self, dst: Bytes, src: Bytes, after: Any) -> Waitable:
        n = dst.numel()
        if src.numel() != n:
            raise TransferError(f"copy of {src.numel()} bytes into {n}")
        with self.driver.on(self.index):
            if after is not None:
                try:
                    self.driver.stream_wait(self.stream, after)  # the caller's prior work comes first
                finally:
                    self.driver.event_destroy(after)
            if n:
                self.driver.copy_async(dst.data_ptr(), src.data_ptr(), n, self.stream)
            if self._torch_stream is not None:
                for t in (dst, src):
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        t.record_stream(self._torch_stream)
            return _DriverEvent(self.driver, self.index, self.driver.event_record(self.stream))

    def close(self) -> None:
        with self._lock:
            mappings, self._mappings = self._mappings, []
        with self.driver.on(self.index):
            self.driver.stream_synchronize(self.stream)
            for m in mappings:
                if not m.closed:
                    m.closed = True
                    try:
                        self.driver.ipc_close(m.base)
                    except DriverError:
                        continue  # the peer's memory is gone already; nothing left to unmap
            if not self._real:
                self.driver.stream_destroy(self.stream)


def default_backend(device: torch.device | str | int | None = None, kind: str | None = None) -> IpcBackend:
    """The backend `kind` ("driver" or "torch"; default $RFORK_CUDA_IPC, else driver where cuda-python
    imports, else torch). BackendUnavailable without CUDA."""
    import os

    chosen = kind or os.environ.get(BACKEND_ENV) or ("driver" if available() else "torch")
    if chosen == "driver":
        return DriverCudaIpc(device)
    if chosen == "torch":
        return TorchCudaIpc(device)
    raise ValueError(f"{BACKEND_ENV}: {chosen!r} is neither 'driver' nor 'torch'")
