"""The compiled cffi module, or one clear line on how to get it."""

from __future__ import annotations

try:
    from backends.providers._libfabric import ffi, lib
except ImportError as exc:  # pragma: no cover - depends on the build machine
    raise ImportError(
        "backends: the libfabric binding is not built; install libfabric-dev (Debian) or set "
        "RFORK_LIBFABRIC_PREFIX to a libfabric install, then reinstall rfork (pip install -e .)"
    ) from exc

__all__ = ["ffi", "lib"]
