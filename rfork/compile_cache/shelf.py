"""A seed's compile caches: which directory holds the artifacts for which key, packed when asked for.

The engine compiles after the weights are loaded, so a seed publishes its key before the artifacts
exist. The archive is therefore packed on request, and only once the directory has stopped changing
(no file written for `settle_s`): a cache still being written would be half a cache. The packed
archive is kept while the directory's files (names, sizes, mtimes) stay the same. Thread-safe.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from rfork.compile_cache.archive import CompileCacheError, Limits, PackedCache, pack
from rfork.compile_cache.key import CompileCacheKey


class CacheNotReady(CompileCacheError):
    """The seed has no artifacts for the key yet, or is still writing them (the fetcher compiles)."""


Signature = tuple[tuple[str, int, int], ...]


class CacheShelf:
    """Compile-cache directories by key (`dirs` and `variants` by its digest, the name on the wire)."""

    def __init__(
        self, dirs: Mapping[CompileCacheKey, Path], *, settle_s: float = 2.0, limits: Limits = Limits()
    ) -> None:
        if settle_s < 0:
            raise ValueError(f"settle_s must be >= 0, got {settle_s}")
        self.dirs = {key.digest(): root for key, root in dirs.items()}
        # what the planner is shown to check that a key is this seed's identity's (anchoring)
        self.variants = {key.digest(): key.variant() for key in dirs}
        self.settle_s = settle_s
        self.limits = limits
        self._lock = threading.Lock()
        self._packed: dict[str, tuple[Signature, PackedCache]] = {}

    def keys(self) -> list[str]:
        return sorted(self.dirs)

    def archive(self, key: str) -> PackedCache:
        """The archive of `key`'s directory. LookupError: not a key of this seed; CacheNotReady: no
        files yet, or written less than `settle_s` ago; CompileCacheError: over the limits."""
        root = self.dirs[key]  # LookupError for another key
        with self._lock:
            sig = _signature(root)
            if not sig:
                raise CacheNotReady(f"compile cache {key[:12]}: nothing compiled yet in {root}")
            newest = max(mtime for _, _, mtime in sig) / 1e9
            if time.time() - newest < self.settle_s:
                raise CacheNotReady(f"compile cache {key[:12]}: still being written")
            cached = self._packed.get(key)
            if cached is not None and cached[0] == sig:
                return cached[1]
            packed = pack(root, key=key, limits=self.limits)
            self._packed[key] = (sig, packed)
            return packed


def _signature(root: Path) -> Signature:
    """(relative path, size, mtime ns) of every regular file under `root`, sorted; () when absent."""
    out = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue  # removed meanwhile
            out.append((os.path.relpath(path, root), st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))
