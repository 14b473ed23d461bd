"""FastLane: a caller-driven endpoint for small ops and batches, with no progress thread and no futures.

The engine's ops hand every chunk to a progress thread and resolve a Future from it: two thread
wake-ups and a Future per op, which is what small ops pay for (docs/transport.md). A lane is one
more endpoint of the engine's provider that only its owner thread touches: `submit` posts a whole
batch with one native call and returns one `Batch` handle; the owner drives completion by polling
or spinning on that handle, on its own thread. Peers need nothing new: a lane only initiates
(reads, writes, immediates) against regions that peers registered with their engines, and their
progress threads serve it like any other initiator.

Thread-safety: a lane belongs to the thread that opened it; another thread gets a TransferError.
Open one lane per thread that needs one (`FastLane(engine)`). The engine knows its lanes only
through the hooks a lane subscribes (region released, engine closing).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backends.descriptor import EngineAddress, MemoryRegionDescriptor
from backends.engine import Region, TransferEngine, as_descriptor, check_imm, check_local, check_remote
from backends.errors import EngineClosed, PeerUnreachable, TransferError, TransferTimeout
from backends.progress import READ, SHM_INJECT_BYTES, WRITE
from backends.providers.domain import EAGAIN, LocalRegistration


@dataclass(slots=True)
class _LaneOp:
    """One posted piece (the attributes post_batch reads) and the batch it belongs to."""

    batch: Batch
    kind: int
    ptr: int
    length: int
    desc: Any
    peer: int
    raddr: int
    key: int
    imm: int | None
    delivery_complete: bool
    ctx: int = 0


class Batch:
    """One completion handle for many ops: poll() or wait() on the lane's owner thread.

    Immediates added with `write_imm` are posted only after every data op of the batch completed,
    so the target sees them after the data landed (no ordering between ops is assumed).
    """

    def __init__(self, lane: FastLane, name: str) -> None:
        self._lane = lane
        self.name = name
        self._ops: list[_LaneOp] = []
        self._after: list[_LaneOp] = []
        self._peers: set[str] = set()
        self.remaining = 0
        self.error: TransferError | None = None
        self.submitted = False
        self.deadline = 0.0
        self.timeout_s = 0.0

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
        self._add(READ, region, [(offset, remote_offset, length)], remote_desc, "read")
        return self

    def write(
        self,
        region: Region,
        offset: int,
        length: int,
        remote_desc: MemoryRegionDescriptor | bytes,
        remote_offset: int,
    ) -> Batch:
        """Add a write of region[offset, +length) to remote [remote_offset, +length)."""
        self._add(WRITE, region, [(offset, remote_offset, length)], remote_desc, "write")
        return self

    def write_spans(
        self,
        region: Region,
        spans: Sequence[tuple[int, int, int]],
        remote_desc: MemoryRegionDescriptor | bytes,
    ) -> Batch:
        """Add writes of (local_offset, remote_offset, length) spans into one remote region."""
        self._add(WRITE, region, spans, remote_desc, "write_spans")
        return self

    def write_imm(self, imm: int, remote_desc: MemoryRegionDescriptor | bytes) -> Batch:
        """Add an immediate for the region's owner, sent once every data op of this batch completed."""
        check_imm(imm)
        lane = self._lane
        rdesc = lane._remote(remote_desc, 0, 0, "write_imm")
        peer, rd, label = lane._peer_for(rdesc, 0)
        self._peers.add(label)
        self._after.append(_LaneOp(self, WRITE, 0, 0, None, peer, rdesc.base, rdesc.keys[rd], imm, False))
        return self

    def _add(
        self,
        kind: int,
        region: Region,
        spans: Sequence[tuple[int, int, int]],
        remote_desc: MemoryRegionDescriptor | bytes,
        what: str,
    ) -> None:
        if self.submitted:
            raise TransferError(f"{self.name}: batch already submitted")
        lane = self._lane
        engine = lane.engine
        rdesc = as_descriptor(remote_desc)
        local_desc = lane._local_desc(region)
        csize = engine.chunk_bytes
        peer, rd, label = lane._peer_for(rdesc, len(self._ops))
        self._peers.add(label)
        key, base = rdesc.keys[rd], rdesc.base
        ops = self._ops
        for lo, ro, n in spans:
            check_local(engine, region, lo, n, what)
            lane._remote(rdesc, ro, n, what)
            for k in range(0, n, csize):
                m = min(csize, n - k)
                ops.append(
                    _LaneOp(
                        self,
                        kind,
                        region.ptr + lo + k,
                        m,
                        local_desc,
                        peer,
                        base + ro + k,
                        key,
                        None,
                        kind == WRITE and lane._delivery_complete,
                    )
                )

    # ----- completion ---------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """True once every op (and trailing immediate) completed or the batch failed."""
        return self.submitted and (self.remaining == 0 or self.error is not None)

    def poll(self) -> bool:
        """Drive the lane once; True when the batch is done. Raises the batch's error, if any."""
        if self.remaining and self.error is None and self.submitted:
            self._lane.progress()
            if self.remaining and self.error is None and time.monotonic() > self.deadline:
                self._lane._expire(self, self.timeout_s)
        if self.error is not None:
            raise self.error
        return self.submitted and not self.remaining

    def wait(self, timeout_s: float | None = None, *, spin_s: float = 0.002) -> None:
        """Spin on the caller's thread until done; after spin_s, yield the CPU between polls.

        timeout_s defaults to the engine's; past it the batch fails with TransferTimeout naming
        the op and the peers (the lane stays usable).
        """
        if self.poll():  # the common case for small ops: done at the first look
            return
        limit = self._lane.engine.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        deadline = start + limit
        spin_until = start + spin_s
        while not self.poll():
            now = time.monotonic()
            if now > deadline:
                self._lane._expire(self, limit)
                self.poll()
            if now > spin_until:
                time.sleep(0.00002 if now - start < 0.05 else 0.0002)

    def _finish_one(self) -> None:
        self.remaining -= 1
        if self.remaining == 0 and self._after:
            after, self._after = self._after, []
            self.remaining = len(after)
            self._lane._queue(after)

    def _fail(self, exc: TransferError) -> None:
        if self.error is None and self.remaining:
            self.error = exc


class FastLane:
    """An initiator-only endpoint driven by its owner thread; see the module docstring."""

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine
        self._dom = engine.open_domain()
        self._owner = threading.get_ident()
        self._delivery_complete = engine.provider != "shm"
        self._small_write_dc = engine.provider == "shm"
        self._mr_local = bool(getattr(self._dom, "mr_local", False))
        self._inflight: dict[int, _LaneOp] = {}
        self._backlog: deque[_LaneOp] = deque()
        self._next_ctx = 1
        self._peers: dict[bytes, tuple[list[int], str]] = {}
        self._regs: dict[int, LocalRegistration] = {}
        self._lock = threading.Lock()  # guards _regs against engine.deregister from other threads
        self.closed = False
        self._unsubscribe = engine.add_hooks(on_release=self._forget, on_close=self.close)

    def batch(self, name: str = "batch") -> Batch:
        """A new, empty batch; add ops to it, then `submit` it."""
        self._check_owner("batch")
        return Batch(self, name)

    def submit(self, batch: Batch, *, timeout_s: float | None = None) -> Batch:
        """Post every op of the batch (one native call when the queue has room) and return it.

        timeout_s (default: the engine's) bounds how long poll() lets it run before it fails.
        """
        self._check_owner("submit")
        if batch.submitted:
            raise TransferError(f"{batch.name}: batch already submitted")
        batch.submitted = True
        batch.timeout_s = self.engine.timeout_s if timeout_s is None else timeout_s
        batch.deadline = time.monotonic() + batch.timeout_s
        ops = batch._ops
        batch._ops = []
        if self._small_write_dc and batch._after:
            for op in ops:
                if op.kind == WRITE and op.length <= SHM_INJECT_BYTES:
                    op.delivery_complete = True
        if ops:
            batch.remaining = len(ops)
            self._queue(ops)
        elif batch._after:
            after, batch._after = batch._after, []
            batch.remaining = len(after)
            self._queue(after)
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

    def progress(self) -> int:
        """Post what the queue has room for and reap completions; returns completions seen."""
        self._check_owner("progress")
        if self.closed:
            raise EngineClosed("lane is closed")
        if self._backlog:
            self._post_backlog()
        return self._reap()

    def _reap(self) -> int:
        """Reap completions (no posting beyond what finished batches queue); returns how many."""
        comps = self._dom.poll()
        inflight = self._inflight
        for c in comps:
            op = inflight.pop(c.context, None)
            if op is None:
                continue  # its batch already failed (timeout); a late completion
            b = op.batch
            if c.error:
                b._fail(
                    PeerUnreachable(
                        f"{b.name} ({'read' if op.kind == READ else 'write'} of {op.length} bytes) "
                        f"with peer {self._label(op.peer)} failed: {c.message}"
                    )
                )
            elif b.error is None:
                b._finish_one()
        if comps and self._backlog:
            self._post_backlog()
        return len(comps)

    def close(self) -> None:
        """Release the endpoint (and any local registrations); batches still running fail."""
        if self.closed:
            return
        # Let posted ops finish first (bounded): closing an endpoint under in-flight ops is where
        # providers are least tested.
        deadline = time.monotonic() + min(self.engine.timeout_s, 2.0)
        while self._inflight and time.monotonic() < deadline:
            try:
                self._reap()
            except TransferError:
                break
        self.closed = True
        for op in [*self._inflight.values(), *self._backlog]:
            op.batch._fail(EngineClosed(f"{op.batch.name}: lane closed"))
        self._inflight.clear()
        self._backlog.clear()
        with self._lock:
            regs, self._regs = list(self._regs.values()), {}
        for reg in regs:
            self._dom.deregister(reg)
        self._dom.close()
        self._unsubscribe()

    def __enter__(self) -> FastLane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- internals ----------------------------------------------------------------------------
    def _queue(self, ops: list[_LaneOp]) -> None:
        if not self._backlog and len(ops) <= self._dom.max_inflight - len(self._inflight):
            rest = self._post(ops)  # the common case: straight to the provider, no queueing
            if rest:
                self._backlog.extend(rest)
            return
        self._backlog.extend(ops)
        self._post_backlog()

    def _post_backlog(self) -> None:
        backlog = self._backlog
        while backlog:
            room = self._dom.max_inflight - len(self._inflight)
            if room <= 0:
                return
            batch = [backlog.popleft() for _ in range(min(room, len(backlog)))]
            rest = self._post([op for op in batch if op.batch.error is None])
            if rest:
                backlog.extendleft(reversed(rest))  # queue full or still connecting: retry on the next poll
                return

    def _post(self, ops: list[_LaneOp]) -> list[_LaneOp]:
        """Post ops in one native call; returns those to retry later (EAGAIN)."""
        ctx = self._next_ctx
        for op in ops:
            op.ctx = ctx
            ctx += 1
        self._next_ctx = ctx
        k, rc, message = self._dom.post_batch(ops)
        inflight = self._inflight
        for op in ops[:k] if k < len(ops) else ops:
            inflight[op.ctx] = op
        if rc == 0:
            return []
        if rc == EAGAIN:
            return ops[k:]
        first = ops[k]
        first.batch._fail(TransferError(f"{first.batch.name} to {self._label(first.peer)}: {message}"))
        return [op for op in ops[k + 1 :] if op.batch is not first.batch]

    def _expire(self, batch: Batch, limit: float | None = None) -> None:
        limit = self.engine.timeout_s if limit is None else limit
        peers = ", ".join(sorted(batch._peers)) or "no peer"
        batch._fail(
            TransferTimeout(
                f"{batch.name} with peer {peers} timed out after {limit:g}s "
                f"({batch.remaining} ops not completed)"
            )
        )
        for ctx in [c for c, op in self._inflight.items() if op.batch is batch]:
            del self._inflight[ctx]  # a late completion for these is dropped
        self._backlog = deque(op for op in self._backlog if op.batch is not batch)

    def _check_owner(self, what: str) -> None:
        if threading.get_ident() != self._owner:
            raise TransferError(f"lane.{what}: a lane is driven only by the thread that opened it")

    def _remote(
        self, remote_desc: MemoryRegionDescriptor | bytes, offset: int, length: int, what: str
    ) -> MemoryRegionDescriptor:
        rdesc = as_descriptor(remote_desc)
        check_remote(rdesc, offset, length, what, need="read" if what == "read" else "write")
        return rdesc

    def _peer_for(self, rdesc: MemoryRegionDescriptor, spread: int) -> tuple[int, int, str]:
        """(handle, remote domain index, label); ops spread over the peer's domains by `spread`."""
        known = self._peers.get(rdesc.address)
        if known is None:
            ea = EngineAddress.from_bytes(rdesc.address)
            if ea.provider != self.engine.provider:
                raise TransferError(f"peer uses provider {ea.provider!r}, this lane {self.engine.provider!r}")
            if len(rdesc.keys) != len(ea.domains):
                raise TransferError("descriptor has a key count different from its engine's domains")
            handles = [self._dom.insert_peer(raw) for raw in ea.domains]
            known = (handles, f"{ea.provider}:{self._dom.straddr(ea.domains[0])}")
            self._peers[rdesc.address] = known
        handles, label = known
        rd = spread % len(handles)
        return handles[rd], rd, label

    def _label(self, handle: int) -> str:
        for handles, label in self._peers.values():
            if handle in handles:
                return label
        return f"peer#{handle}"

    def _local_desc(self, region: Region) -> Any:
        """The lane's local descriptor for region: None unless the provider needs FI_MR_LOCAL."""
        if not self._mr_local:
            return None
        with self._lock:
            reg = self._regs.get(id(region))
            if reg is None:
                reg = self._dom.register(region.ptr, region.nbytes, False, False)
                self._regs[id(region)] = reg
        return reg.desc

    def _forget(self, region: Region) -> None:
        """Drop the lane's registration of a region being deregistered (any thread)."""
        with self._lock:
            reg = self._regs.pop(id(region), None)
        if reg is not None:
            self._dom.deregister(reg)
