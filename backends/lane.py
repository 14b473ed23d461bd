"""FastLane: batches of small ops behind one handle, on the engine's one op path.

A batch collects reads, writes and immediates (each checked as it is added, by the engine's own
checks) and goes to the engine's native progress cores as ONE op when submitted: one future, one
wake-up for the whole batch instead of one per op. There is no second implementation of posting,
completion or checks here; a lane is only a front-end that keeps the batch API (docs/transport.md).

Thread-safety: a lane belongs to the thread that opened it; another thread gets a TransferError
(open one lane per thread that needs one). Immediates added with `write_imm` are posted only after
every data op of the batch completed, so the target sees them after the data landed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout

from backends.descriptor import MemoryRegionDescriptor
from backends.engine import Region, TransferEngine
from backends.errors import EngineClosed, TransferError, TransferTimeout
from backends.progress import Op, Part


class Batch:
    """One completion handle for many ops: poll() or wait() on the lane's owner thread."""

    def __init__(self, lane: FastLane, name: str) -> None:
        self._lane = lane
        self.name = name
        self._parts: list[Part] = []
        self._op: Op | None = None
        self.timeout_s = lane.engine.timeout_s

    @property
    def submitted(self) -> bool:
        return self._op is not None

    # ----- building -----------------------------------------------------------------------------
    def read(
        self,
        region: Region,
        offset: int,
        length: int,
        remote_desc: MemoryRegionDescriptor | bytes,
        remote_offset: int,
    ) -> Batch:
        """Add a read of remote [remote_offset, +length) into region[offset, +length)."""
        return self._add(self._lane.engine.read_part(region, offset, length, remote_desc, remote_offset))

    def write(
        self,
        region: Region,
        offset: int,
        length: int,
        remote_desc: MemoryRegionDescriptor | bytes,
        remote_offset: int,
    ) -> Batch:
        """Add a write of region[offset, +length) to remote [remote_offset, +length)."""
        engine = self._lane.engine
        return self._add(
            engine.write_part(region, [(offset, remote_offset, length)], remote_desc, what="write")
        )

    def write_spans(
        self,
        region: Region,
        spans: Sequence[tuple[int, int, int]],
        remote_desc: MemoryRegionDescriptor | bytes,
    ) -> Batch:
        """Add writes of (local_offset, remote_offset, length) spans into one remote region."""
        return self._add(self._lane.engine.write_part(region, spans, remote_desc))

    def write_imm(self, imm: int, remote_desc: MemoryRegionDescriptor | bytes) -> Batch:
        """Add an immediate for the region's owner, sent once every data op of this batch completed."""
        return self._add(self._lane.engine.imm_part(imm, remote_desc))

    def _add(self, part: Part) -> Batch:
        self._lane._check_owner(self.name)
        if self._op is not None:
            raise TransferError(f"{self.name}: batch already submitted")
        self._parts.append(part)
        return self

    # ----- completion ---------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """True once every op (and trailing immediate) completed or the batch failed."""
        return self._op is not None and self._op.future.done()

    def poll(self) -> bool:
        """True when the batch is done; raises the batch's error, if any."""
        if not self.done:
            return False
        assert self._op is not None
        self._op.future.result()
        return True

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until done (in C or on a lock, without spinning); past timeout_s (default: the
        submit's) the batch fails with TransferTimeout naming it and its peers."""
        if self._op is None:
            raise TransferError(f"{self.name}: batch not submitted")
        limit = self.timeout_s if timeout_s is None else timeout_s
        op = self._op
        try:
            op.future.result(limit)
        except FutureTimeout:
            # Its posted chunks stay posted (their regions pinned) until the provider completes them.
            op.fail(TransferTimeout(f"{self.name} with peer {op.peer} timed out after {limit:g}s"))
            op.future.result()


class FastLane:
    """A batch front-end on an engine, owned by the thread that opened it; see the module docstring."""

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine
        self._owner = threading.get_ident()
        self.closed = False

    def batch(self, name: str = "batch") -> Batch:
        """A new, empty batch; add ops to it, then `submit` it."""
        self._check_owner("batch")
        return Batch(self, name)

    def submit(self, batch: Batch, *, timeout_s: float | None = None) -> Batch:
        """Post every op of the batch as one engine op and return it; timeout_s (default: the
        engine's) is how long wait() lets it run."""
        self._check_owner("submit")
        if batch.submitted:
            raise TransferError(f"{batch.name}: batch already submitted")
        if timeout_s is not None:
            batch.timeout_s = timeout_s
        batch._op = self.engine.start_op(batch.name, batch._parts)
        return batch

    def read(
        self,
        region: Region,
        offset: int,
        length: int,
        remote_desc: MemoryRegionDescriptor | bytes,
        remote_offset: int,
    ) -> Batch:
        """Submit one read; wait on the returned handle."""
        return self.submit(self.batch("read").read(region, offset, length, remote_desc, remote_offset))

    def write(
        self,
        region: Region,
        offset: int,
        length: int,
        remote_desc: MemoryRegionDescriptor | bytes,
        remote_offset: int,
    ) -> Batch:
        """Submit one write; wait on the returned handle."""
        return self.submit(self.batch("write").write(region, offset, length, remote_desc, remote_offset))

    def close(self) -> None:
        """Refuse further batches; submitted ones run on in the engine (which owns their chunks)."""
        self.closed = True

    def __enter__(self) -> FastLane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_owner(self, what: str) -> None:
        if threading.get_ident() != self._owner:
            raise TransferError(
                f"{what}: a FastLane belongs to the thread that opened it; open one per thread"
            )
        if self.closed:
            raise EngineClosed(f"{what}: lane is closed")
