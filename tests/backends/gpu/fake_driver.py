"""A CPU fake of the cuda-python driver calls backends.gpu.driver makes, for rehearsing on CPU.

"Device memory" is host memory from `malloc` (CPU tensors, known as allocations so that
cuMemGetAddressRange finds their base); an IPC handle names an allocation and opening it returns the
same address (one process: the memory is right there). Calls that need a context fail with
CUDA_ERROR_INVALID_CONTEXT unless the calling thread pushed one, as the real driver does on a thread
where none is current, and events and mappings are counted so tests can see nothing leaked.
"""

from __future__ import annotations

import ctypes
import itertools
import secrets
import threading
from typing import Any

import torch

SUCCESS, INVALID_VALUE, INVALID_CONTEXT, INVALID_HANDLE = 0, 1, 201, 400
NAMES = {SUCCESS: "CUDA_SUCCESS", INVALID_VALUE: "CUDA_ERROR_INVALID_VALUE",
         INVALID_CONTEXT: "CUDA_ERROR_INVALID_CONTEXT", INVALID_HANDLE: "CUDA_ERROR_INVALID_HANDLE"}


class CUipcMemHandle:
    """64 bytes at a stable address, like the binding's struct (getPtr)."""

    def __init__(self) -> None:
        self._buf = ctypes.create_string_buffer(64)

    def getPtr(self) -> int:  # noqa: N802 - the binding's name
        return ctypes.addressof(self._buf)


class FakeDriver:
    """The subset of cuda.bindings.driver used by backends.gpu.driver, on CPU memory."""

    CUipcMemHandle: type[CUipcMemHandle] = CUipcMemHandle

    def __init__(self) -> None:
        self.allocations: dict[int, torch.Tensor] = {}  # base -> backing tensor
        self.handles: dict[bytes, int] = {}  # handle -> base
        self.open_count: dict[int, int] = {}  # base -> opens not yet closed
        self.live_events: set[int] = set()
        self.log: list[tuple[Any, ...]] = []
        self._ids = itertools.count(1)
        self._tls = threading.local()
        self.lock = threading.Lock()

    # ----- test helpers
    def malloc(self, nbytes: int) -> torch.Tensor:
        """A fresh "device allocation" of nbytes (zeros)."""
        t = torch.zeros(nbytes, dtype=torch.uint8)
        self.allocations[int(t.data_ptr())] = t
        return t

    def _stack(self) -> list[Any]:
        if not hasattr(self._tls, "stack"):
            self._tls.stack = []
        return self._tls.stack

    def _needs_ctx(self) -> int:
        return SUCCESS if self._stack() else INVALID_CONTEXT

    # ----- the driver API
    def cuInit(self, flags: int) -> tuple[int]:  # noqa: N802
        return (SUCCESS,)

    def cuGetErrorName(self, err: int) -> tuple[int, bytes]:  # noqa: N802
        return (SUCCESS, NAMES.get(int(err), f"CUDA_ERROR_{int(err)}").encode())

    def cuDeviceGet(self, ordinal: int) -> tuple[int, int]:  # noqa: N802
        return (SUCCESS, ordinal) if ordinal == 0 else (INVALID_VALUE, 0)

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[int, str]:  # noqa: N802
        return (SUCCESS, f"ctx{dev}")

    def cuCtxPushCurrent(self, ctx: str) -> tuple[int]:  # noqa: N802
        self._stack().append(ctx)
        return (SUCCESS,)

    def cuCtxPopCurrent(self) -> tuple[int, Any]:  # noqa: N802
        stack = self._stack()
        return (SUCCESS, stack.pop()) if stack else (INVALID_CONTEXT, None)

    def cuMemGetAddressRange(self, ptr: int) -> tuple[int, int, int]:  # noqa: N802
        if self._needs_ctx():
            return (INVALID_CONTEXT, 0, 0)
        for base, t in self.allocations.items():
            if base <= ptr < base + t.numel():
                return (SUCCESS, base, t.numel())
        return (INVALID_VALUE, 0, 0)

    def cuIpcGetMemHandle(self, base: int) -> tuple[int, Any]:  # noqa: N802
        if self._needs_ctx():
            return (INVALID_CONTEXT, None)
        if base not in self.allocations:
            return (INVALID_VALUE, None)
        h = CUipcMemHandle()
        raw = next((k for k, v in self.handles.items() if v == base), None) or secrets.token_bytes(64)
        self.handles[raw] = base
        ctypes.memmove(h.getPtr(), raw, 64)
        return (SUCCESS, h)

    def cuIpcOpenMemHandle(self, h: Any, flags: int) -> tuple[int, int]:  # noqa: N802
        if self._needs_ctx():
            return (INVALID_CONTEXT, 0)
        base = self.handles.get(ctypes.string_at(h.getPtr(), 64))
        if base is None or base not in self.allocations or flags != 1:
            return (INVALID_HANDLE, 0)
        with self.lock:
            self.open_count[base] = self.open_count.get(base, 0) + 1
        return (SUCCESS, base)

    def cuIpcCloseMemHandle(self, base: int) -> tuple[int]:  # noqa: N802
        with self.lock:
            if self.open_count.get(base, 0) <= 0:
                return (INVALID_VALUE,)
            self.open_count[base] -= 1
        return (SUCCESS,)

    def cuStreamCreate(self, flags: int) -> tuple[int, int]:  # noqa: N802
        return (self._needs_ctx(), 1000 + next(self._ids))

    def cuStreamDestroy(self, stream: int) -> tuple[int]:  # noqa: N802
        return (self._needs_ctx(),)

    def cuStreamSynchronize(self, stream: int) -> tuple[int]:  # noqa: N802
        return (self._needs_ctx(),)

    def cuEventCreate(self, flags: int) -> tuple[int, int]:  # noqa: N802
        if self._needs_ctx():
            return (INVALID_CONTEXT, 0)
        ev = next(self._ids)
        with self.lock:
            self.live_events.add(ev)
        return (SUCCESS, ev)

    def cuEventRecord(self, ev: int, stream: int) -> tuple[int]:  # noqa: N802
        self.log.append(("record", ev, stream, threading.get_ident()))
        return (self._needs_ctx(),)

    def cuStreamWaitEvent(self, stream: int, ev: int, flags: int) -> tuple[int]:  # noqa: N802
        self.log.append(("wait", stream, ev))
        return (self._needs_ctx(),)

    def cuEventSynchronize(self, ev: int) -> tuple[int]:  # noqa: N802
        return (self._needs_ctx(),)

    def cuEventDestroy(self, ev: int) -> tuple[int]:  # noqa: N802
        with self.lock:
            if ev not in self.live_events:
                return (INVALID_HANDLE,)
            self.live_events.discard(ev)
        return (SUCCESS,)

    def cuMemcpyDtoDAsync(self, dst: int, src: int, n: int, stream: int) -> tuple[int]:  # noqa: N802
        if self._needs_ctx():
            return (INVALID_CONTEXT,)
        self.log.append(("copy", dst, src, n, stream))
        ctypes.memmove(dst, src, n)
        return (SUCCESS,)
