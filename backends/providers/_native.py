"""The compiled cffi module bound to the chosen libfabric at run time, or one clear line on how to get it.

The module is compiled against libfabric 1.x headers and needs only the FABRIC_1.0-1.3 symbol
versions, so any libfabric >= 1.17 serves it. Which copy is loaded is chosen by RFORK_LIBFABRIC_LIB:
  system   (default) $RFORK_LIBFABRIC_PREFIX/lib{64,}/libfabric.so.1 when that variable is set (AWS's
           EFA installer: /opt/amazon/efa), else the one the dynamic loader finds (Debian's 1.17)
  mpich    the libfabric 2.5.1 that PyPI's `mpich` wheel bundles (lib/mpich/libfabric.so.1; extra
           `libfabric2`, which scripts/dev.sh installs)
  <path>   a libfabric.so.1 file
The default stays `system` while 2.5.1's shm crashes with two endpoints of one process writing to
each other (docs/transport.md, "libfabric versions"). A non-system copy is preloaded with
RTLD_GLOBAL before the module is imported: the loader then binds the module's `libfabric.so.1`
dependency to that already-loaded SONAME. The choice is made once per process; spawned children
inherit the variable and choose the same.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import signal
from collections.abc import Iterator
from importlib import metadata
from typing import Any

LIB_ENV = "RFORK_LIBFABRIC_LIB"
PREFIX_ENV = "RFORK_LIBFABRIC_PREFIX"
_MPICH_SUFFIX = "mpich/libfabric.so.1"


def mpich_libfabric() -> str | None:
    """Path of the libfabric bundled by the installed `mpich` wheel, or None without one."""
    try:
        files = metadata.distribution("mpich").files or []
    except metadata.PackageNotFoundError:
        return None
    for entry in files:
        if str(entry).replace(os.sep, "/").endswith(_MPICH_SUFFIX):
            path = os.path.realpath(str(entry.locate()))
            if os.path.exists(path):
                return path
    return None


def chosen_library(setting: str | None, prefix: str | None = None) -> str | None:
    """The libfabric file to preload for an RFORK_LIBFABRIC_LIB value (and RFORK_LIBFABRIC_PREFIX);
    None means the one the dynamic loader finds.

    ImportError (naming the setting) when it names something that is not there.
    """
    value = (setting or "system").strip() or "system"
    if value == "system":
        if not prefix:
            return None
        for libdir in ("lib64", "lib"):
            candidate = os.path.join(prefix, libdir, "libfabric.so.1")
            if os.path.isfile(candidate):
                return os.path.realpath(candidate)
        raise ImportError(f"{PREFIX_ENV}={prefix!r}: no lib64/libfabric.so.1 or lib/libfabric.so.1 there")
    if value == "mpich":
        path = mpich_libfabric()
        if path is None:
            raise ImportError(
                f"{LIB_ENV}=mpich but the `mpich` wheel is not installed: pip install 'rfork[libfabric2]' "
                f"(or set {LIB_ENV}=system)"
            )
        return path
    if not os.path.isfile(value):
        raise ImportError(f"{LIB_ENV}={value!r}: no such file; use system, mpich or a libfabric.so.1 path")
    return os.path.realpath(value)


# Bytes enough for the C `struct sigaction` of any Linux libc (glibc x86_64/aarch64: 152), kept opaque.
_SIGACTION_BYTES = 512


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """Put back every C-level signal disposition that loading libfabric changed.

    libfabric pulls in libraries whose constructors install handlers of their own (Debian's
    libinfinipath, a dependency of its psm provider: SIGINT, SIGTERM, SIGSEGV, SIGBUS, ...) that tidy
    up hardware rfork never uses and then end the process with status 1 and no output, or crash. The
    process's own handlers (Python's, rfork's, faulthandler's, a framework's) must keep the signals.
    sigaction is process-wide, so this works on any thread; the struct is saved and restored as bytes.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    before: dict[int, bytes] = {}
    for sig in range(1, signal.NSIG):
        buf = ctypes.create_string_buffer(_SIGACTION_BYTES)
        if libc.sigaction(sig, None, buf) == 0:
            before[sig] = buf.raw
    try:
        yield
    finally:
        for sig, saved in before.items():
            now = ctypes.create_string_buffer(_SIGACTION_BYTES)
            if libc.sigaction(sig, None, now) == 0 and now.raw != saved:
                libc.sigaction(sig, ctypes.create_string_buffer(saved, _SIGACTION_BYTES), None)


LIBRARY = chosen_library(os.environ.get(LIB_ENV), os.environ.get(PREFIX_ENV))
with _signal_handlers_kept():
    if LIBRARY is not None:
        try:
            ctypes.CDLL(LIBRARY, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise ImportError(f"{LIB_ENV}: cannot load {LIBRARY}: {exc}") from exc
    else:
        # The system copy, loaded here rather than as the module's dependency below: ctypes lets go of
        # the GIL while it loads (~0.2 s on Debian, whose psm libraries calibrate a clock in their
        # constructors), so a helper thread that loads the binding (backends.load_binding_soon) does
        # not stall the interpreter. The module's `libfabric.so.1` then binds to this one. A missing
        # library is reported by the import below.
        with contextlib.suppress(OSError):
            ctypes.CDLL("libfabric.so.1")
    try:
        from backends.providers._libfabric import ffi, lib
    except ImportError as exc:  # pragma: no cover - depends on the build machine
        if importlib.util.find_spec("backends.providers._libfabric") is None:
            raise ImportError(
                "backends: the libfabric binding is not built (rfork was built with RFORK_SKIP_NATIVE=1, or "
                "from a source tree never installed); install libfabric-dev (Debian) or set "
                "RFORK_LIBFABRIC_PREFIX to a libfabric install, then reinstall rfork (pip install -e .)"
            ) from exc
        raise ImportError(
            f"backends: the libfabric binding cannot load: {exc}. It needs libfabric.so.1 (>= 1.17; Debian: "
            f"libfabric1) and libxxhash.so.0 (Debian: libxxhash0), or {PREFIX_ENV} / {LIB_ENV}=mpich"
        ) from exc


def buffer_address(obj: Any) -> tuple[int, int, Any]:
    """(address, nbytes, object to keep alive) of anything with the buffer protocol, read-only too.

    TypeError when obj has no buffer.
    """
    cbuf = ffi.from_buffer(obj, require_writable=False)
    return int(ffi.cast("uintptr_t", cbuf)), len(cbuf), (obj, cbuf)


def _version() -> tuple[int, int]:
    raw = int(lib.fi_version())
    return raw >> 16, raw & 0xFFFF


VERSION: tuple[int, int] = _version()
"""(major, minor) of the libfabric loaded at run time (fi_version), e.g. (1, 17) or (2, 5)."""

__all__ = ["LIBRARY", "VERSION", "buffer_address", "ffi", "lib", "mpich_libfabric"]
