"""Digests computed where reads land: a native thread hashes a pull's spans (xxh3-128) as reads land.

A `DigestJob` holds a digest plan: per destination region its base address and size, the reads
that fill it (offset, length; sorted, disjoint) and the spans to digest (offset, end; sorted by
offset, may overlap). Reads posted with `TransferEngine.read(..., digest=job)` carry the job to the
core thread of their domain, which, when one lands, records it before the read's future resolves;
the job's own native thread then feeds every byte below the landed prefix of each region to the
spans' streaming xxh3-128 states in address order, right after the bytes landed, while the core goes
on reading. The digests equal `rfork.weights.checksum.StreamingDigest("xxh3-128")` over each span's
bytes.

Release the job (`release`, or use it as a context manager) before the destination memory goes:
after release nothing is hashed any more, and a hash under way is waited for. The native job itself
lives on until no queued or posted read refers to it (a timed-out read may still land).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from backends.errors import TransferError
from backends.providers._native import ffi, lib

if TYPE_CHECKING:
    from backends.providers._libfabric import CData

log = logging.getLogger(__name__)

Extent = tuple[int, int]


def native_digests_available() -> bool:
    """Whether the binding was built with xxHash (scripts/dev.sh installs it; else pulls hash in Python)."""
    return bool(lib.rf_hjob_supported())


class DigestJob:
    """The digest plan of one pull and its native state (see the module docstring). Thread-safe."""

    def __init__(
        self,
        regions: Sequence[Extent],
        reads: Sequence[Sequence[Extent]],
        spans: Sequence[Sequence[Extent]],
    ) -> None:
        """regions: (base address, size) each; reads[q]: (offset, length) in region q, sorted and
        disjoint; spans[q]: (offset, end) in region q, sorted by offset. Raises TransferError
        without native digests (`native_digests_available`)."""
        if not (len(regions) == len(reads) == len(spans)):
            raise ValueError(
                f"DigestJob: {len(regions)} regions, {len(reads)} read lists, {len(spans)} span lists"
            )
        for q, ((_base, size), rds, sps) in enumerate(zip(regions, reads, spans, strict=True)):
            end = 0
            for off, n in rds:
                if off < end or n <= 0 or off + n > size:
                    raise ValueError(f"DigestJob: region {q}: read ({off}, {n}) unsorted, empty or outside")
                end = off + n
            unsorted = list(sps) != sorted(sps, key=lambda s: s[0])
            if unsorted or any(b < a or a < 0 or b > size for a, b in sps):
                raise ValueError(f"DigestJob: region {q}: spans must be sorted and inside the region")
        self.span_count = sum(len(s) for s in spans)
        self._handle = lib.rf_hjob_new(
            len(regions),
            ffi.new("uint64_t[]", [b for b, _ in regions] or [0]),
            ffi.new("uint64_t[]", [n for _, n in regions] or [0]),
            ffi.new("long[]", [len(r) for r in reads] or [0]),
            ffi.new("uint64_t[]", [v for rds in reads for ext in rds for v in ext] or [0]),
            ffi.new("long[]", [len(s) for s in spans] or [0]),
            ffi.new("uint64_t[]", [v for sps in spans for ext in sps for v in ext] or [0]),
        )
        if self._handle == ffi.NULL:
            raise TransferError(
                "native digests unavailable (binding built without xxHash, or out of memory)"
                if native_digests_available()
                else "native digests unavailable: the binding was built without xxHash (libxxhash-dev)"
            )
        self.address = int(ffi.cast("uintptr_t", self._handle))

    def wait(self, timeout_s: float) -> None:
        """Wait until every span is digested (call after every read resolved). TimeoutError when it
        takes longer; TransferError when a read landed outside the plan or could not be tracked."""
        handle = self._require()
        until = time.monotonic() + timeout_s
        while True:
            left = until - time.monotonic()
            if left <= 0:
                raise TimeoutError("digest job: spans still being hashed at the deadline")
            rc = lib.rf_hjob_wait(handle, max(1, min(int(left * 1000), 1000)))
            if rc == 1:
                return
            if rc < 0:
                raise TransferError("digest job failed: a read landed outside its plan or was not tracked")

    def hexdigests(self) -> list[str]:
        """Each span's xxh3-128 as hex (regions in order, spans in the order given); after `wait`."""
        handle = self._require()
        out = ffi.new("unsigned char[]", 16 * max(self.span_count, 1))
        done = lib.rf_hjob_digests(handle, out, self.span_count)
        if done != self.span_count:
            left = self.span_count - done
            raise TransferError(f"digest job: {left} of {self.span_count} spans not finished")
        raw = bytes(ffi.buffer(out, 16 * self.span_count))
        return [raw[i : i + 16].hex() for i in range(0, len(raw), 16)]

    @property
    def hash_seconds(self) -> float:
        """Seconds spent hashing for this job so far (on its native thread)."""
        return int(lib.rf_hjob_hash_ns(self._require())) / 1e9

    def release(self) -> None:
        """Stop hashing (joins the job's thread) and drop Python's hold; idempotent."""
        handle, self._handle = self._handle, ffi.NULL
        if handle != ffi.NULL:
            lib.rf_hjob_release(handle)

    def _require(self) -> CData:
        if self._handle == ffi.NULL:
            raise TransferError("digest job already released")
        return self._handle

    def __enter__(self) -> DigestJob:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __del__(self) -> None:
        if getattr(self, "_handle", ffi.NULL) != ffi.NULL:
            log.debug("digest job garbage-collected unreleased; releasing it")
            self.release()
