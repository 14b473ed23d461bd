"""The few CUDA driver calls rfork makes itself, through cuda-python (``cuda.bindings.driver``).

Why the driver and not torch here: an IPC handle must name a whole allocation (``cuMemGetAddressRange``
finds the base of whatever allocation holds a tensor, ``cuIpcGetMemHandle`` exports it), an opened
peer allocation is raw device memory that torch has no public type for (``cuIpcOpenMemHandle``, then
``cuMemcpyDtoDAsync`` on a stream, ordered by driver events), and a DMA-BUF file descriptor of GPU
memory for a fabric's registration exists only there (``cuMemGetHandleForAddressRange``).

cuda-python is imported lazily (it is on GPU machines, not a dependency of rfork): ``Driver()`` loads
it, ``Driver(module)`` takes any object with the same functions, which is how the tests run this
module's logic on CPU (tests/backends/gpu/fake_driver.py). Every call checks its CUresult and raises
``DriverError`` naming the call and CUDA's error name. Calls run inside ``on(device)``, which pushes
the device's primary context (the one torch's runtime uses) for the calling thread and pops it after,
so any thread may call and no caller's current context changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from typing import Any

IPC_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, the only flag cuIpcOpenMemHandle takes
_EVENT_DISABLE_TIMING = 2  # CU_EVENT_DISABLE_TIMING
_STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING
_DMA_BUF_FD = 1  # CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
_ATTR_DMA_BUF_SUPPORTED = 124  # CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED


class DriverError(RuntimeError):
    """A CUDA driver call failed (``call`` names it, ``code`` is CUDA's error name)."""

    def __init__(self, call: str, code: str) -> None:
        super().__init__(f"{call} failed: {code}")
        self.call = call
        self.code = code


def available() -> bool:
    """Whether cuda-python's driver bindings import here (a GPU is another question)."""
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return False
    return True


def _enum(module: Any, cls: str, member: str, default: int) -> Any:
    """module.cls.member where the binding has it (names moved between releases), else the number."""
    owner = getattr(module, cls, None)
    return getattr(owner, member, default) if owner is not None else default


class Driver:
    """Checked wrappers of the driver calls above. Thread-safe (the driver is; the context cache locks)."""

    def __init__(self, module: Any = None) -> None:
        if module is None:
            from cuda.bindings import driver  # lazily: only GPU machines have it

            module = driver
        self.cu: Any = module
        self._ctx: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._check("cuInit", self.cu.cuInit(0))

    # ----- plumbing -----------------------------------------------------------------------------
    def _check(self, call: str, result: Any) -> Any:
        """The values after CUresult: None, one value, or a tuple; DriverError unless CUDA_SUCCESS."""
        values = result if isinstance(result, tuple) else (result,)
        err, rest = values[0], values[1:]
        if int(err) != 0:
            name: Any = f"error {int(err)}"
            got = self.cu.cuGetErrorName(err)
            if isinstance(got, tuple) and int(got[0]) == 0 and got[1]:
                name = got[1].decode() if isinstance(got[1], bytes) else str(got[1])
            raise DriverError(call, str(name))
        if not rest:
            return None
        return rest[0] if len(rest) == 1 else rest

    def _primary(self, device: int) -> Any:
        with self._lock:
            ctx = self._ctx.get(device)
            if ctx is None:
                dev = self._check("cuDeviceGet", self.cu.cuDeviceGet(device))
                ctx = self._check("cuDevicePrimaryCtxRetain", self.cu.cuDevicePrimaryCtxRetain(dev))
                self._ctx[device] = ctx
            return ctx

    @contextlib.contextmanager
    def on(self, device: int) -> Iterator[None]:
        """Run the body with `device`'s primary context current on this thread, then restore."""
        self._check("cuCtxPushCurrent", self.cu.cuCtxPushCurrent(self._primary(device)))
        try:
            yield
        finally:
            self._check("cuCtxPopCurrent", self.cu.cuCtxPopCurrent())

    # ----- allocations and IPC (call inside on(device)) -----------------------------------------
    def address_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation holding device pointer `ptr`."""
        base, size = self._check("cuMemGetAddressRange", self.cu.cuMemGetAddressRange(ptr))
        return int(base), int(size)

    def ipc_handle(self, base: int) -> bytes:
        """The 64-byte IPC handle of the allocation starting at `base`."""
        handle = self._check("cuIpcGetMemHandle", self.cu.cuIpcGetMemHandle(base))
        return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)

    def ipc_open(self, handle: bytes) -> int:
        """Map another process's allocation (by its IPC handle) here; its base pointer in this process.

        Opening a handle this context has open already returns the same pointer and counts once more."""
        if len(handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes, not {len(handle)}")
        h = self.cu.CUipcMemHandle()
        ctypes.memmove(h.getPtr(), handle, IPC_HANDLE_BYTES)
        flag = _enum(self.cu, "CUipcMem_flags", "CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS",
                     _LAZY_ENABLE_PEER_ACCESS)
        return int(self._check("cuIpcOpenMemHandle", self.cu.cuIpcOpenMemHandle(h, flag)))

    def ipc_close(self, base: int) -> None:
        """Unmap what ipc_open returned (once per open)."""
        self._check("cuIpcCloseMemHandle", self.cu.cuIpcCloseMemHandle(base))

    # ----- streams, events, copies --------------------------------------------------------------
    def stream_create(self) -> int:
        """A non-blocking stream (does not wait on the legacy default stream)."""
        flag = _enum(self.cu, "CUstream_flags", "CU_STREAM_NON_BLOCKING", _STREAM_NON_BLOCKING)
        return int(self._check("cuStreamCreate", self.cu.cuStreamCreate(flag)))

    def stream_destroy(self, stream: int) -> None:
        self._check("cuStreamDestroy", self.cu.cuStreamDestroy(stream))

    def stream_synchronize(self, stream: int) -> None:
        self._check("cuStreamSynchronize", self.cu.cuStreamSynchronize(stream))

    def event_record(self, stream: int) -> Any:
        """A new event recorded on `stream` (timing off: cheapest)."""
        flag = _enum(self.cu, "CUevent_flags", "CU_EVENT_DISABLE_TIMING", _EVENT_DISABLE_TIMING)
        event = self._check("cuEventCreate", self.cu.cuEventCreate(flag))
        try:
            self._check("cuEventRecord", self.cu.cuEventRecord(event, stream))
        except DriverError:
            self.cu.cuEventDestroy(event)
            raise
        return event

    def stream_wait(self, stream: int, event: Any) -> None:
        """Work queued on `stream` after this waits for `event`."""
        self._check("cuStreamWaitEvent", self.cu.cuStreamWaitEvent(stream, event, 0))

    def event_synchronize(self, event: Any) -> None:
        self._check("cuEventSynchronize", self.cu.cuEventSynchronize(event))

    def event_destroy(self, event: Any) -> None:
        """Release an event; one still pending is released once it completes (CUDA's rule)."""
        self._check("cuEventDestroy", self.cu.cuEventDestroy(event))

    def copy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a device-to-device copy of nbytes on `stream` (same device or peer-mapped)."""
        self._check("cuMemcpyDtoDAsync", self.cu.cuMemcpyDtoDAsync(dst, src, nbytes, stream))

    # ----- DMA-BUF ------------------------------------------------------------------------------
    def dmabuf_supported(self, device: int) -> bool:
        """Whether the GPU and its driver hand out DMA-BUF file descriptors of device memory."""
        dev = self._check("cuDeviceGet", self.cu.cuDeviceGet(device))
        attr = _enum(self.cu, "CUdevice_attribute", "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED",
                     _ATTR_DMA_BUF_SUPPORTED)
        return bool(self._check("cuDeviceGetAttribute", self.cu.cuDeviceGetAttribute(attr, dev)))

    def dmabuf_fd(self, base: int, nbytes: int) -> int:
        """A DMA-BUF file descriptor of [base, +nbytes) (both host-page aligned): what a provider with
        FI_HMEM registers (fi_mr_regattr with a dmabuf). The caller closes it."""
        kind = _enum(self.cu, "CUmemRangeHandleType", "CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD", _DMA_BUF_FD)
        return int(self._check("cuMemGetHandleForAddressRange",
                               self.cu.cuMemGetHandleForAddressRange(base, nbytes, kind, 0)))


_shared: Driver | None = None
_shared_lock = threading.Lock()


def shared_driver() -> Driver:
    """The process's Driver over cuda-python (ImportError without it, DriverError without a GPU)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Driver()
        return _shared
