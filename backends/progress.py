"""Progress: per domain, a native core posts and polls; a Python thread resolves ops in batches.

An op (one engine call or lane batch, made of checked `Part`s) is cut into pieces of at most
chunk_bytes and spread over the domains: a read's pieces one chunk each, round-robin; a write's
pieces in batches, one chunk per batch, which the core gathers into multi-iov writes and completes
as one record (Progress.submit). Each domain's native core (C, one pthread, see
backends/providers/native/progress_core.c) alone touches its endpoint: it posts queued chunks, polls the
completion queue and sleeps on its wait object when idle, so the passive side of a transfer keeps
serving peers while its application sleeps, and any thread may submit. Its `ProgressThread` waits
for completion records in C without the GIL and resolves futures, counts immediates and enforces
deadlines, a batch at a time. A chunk's local region is pinned (`LocalRegion.pin`) from submission
until its completion record arrives: its memory outlives every posted op, even one whose op already
timed out. Future callbacks run on a progress thread.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import random
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from backends.errors import EngineClosed, PeerUnreachable, RemoteAccessError, TransferError, TransferTimeout
from backends.providers.domain import (
    POST_FAILED,
    RECV_BASE,
    Completion,
    Domain,
    LocalRegistration,
    WriteBatch,
)
from backends.spans import cut_spans

log = logging.getLogger(__name__)

READ, WRITE, SEND = 0, 1, 2
_OP_NAMES = {READ: "read", WRITE: "write", SEND: "send"}
MAX_MESSAGE = 64 * 1024  # bytes of one two-sided message (the receive buffers' size)
# shm 1.17 completes writes up to its inject size when they are queued, not when they land; larger
# writes complete after the copy. Only those small ones need delivery-complete before an immediate.
SHM_INJECT_BYTES = 4096
# a batch of write pieces is one chunk to Python: at most this many pieces and (about) this many bytes
BATCH_PIECES = 256
BATCH_BYTES = 8 << 20
_RECV_BASE = RECV_BASE  # contexts of posted receive buffers
_RECV_COUNT = 16
_ACCESS_ERRNOS = {errno.EACCES, errno.EPERM, errno.EINVAL, errno.ENOKEY, errno.EKEYREJECTED, errno.EFAULT}
_ctx_ids = itertools.count(1)
_op_ids = itertools.count(1)


class LocalRegion(Protocol):
    """An op's local region: its address, a registration per domain, and a pin per posted chunk
    (unpinned when the provider completed it: only then may its memory go)."""

    ptr: int
    regs: list[LocalRegistration]

    def pin(self) -> None: ...

    def unpin(self) -> None: ...


@dataclass(slots=True)
class Route:
    """How this engine reaches one peer: a label for errors and a handle per local domain."""

    label: str
    handles: list[int]
    remote_domains: int


@dataclass(frozen=True, slots=True)
class Part:
    """One checked piece of an op: (local_offset, remote_offset, length) spans of one kind between a
    local region (None for an immediate alone) and one remote region, and an optional immediate that
    arrives after the part's data."""

    kind: int
    region: LocalRegion | None
    spans: Sequence[tuple[int, int, int]]
    route: Route
    base: int
    keys: Sequence[int]
    imm: int | None = None
    hash_job: int = 0  # a read's backends.digest_job.DigestJob address (0: none)


class Op:
    """One user-visible op: a future and the count of chunks still outstanding."""

    __slots__ = ("future", "id", "imm_after", "lock", "name", "peer", "remaining")

    def __init__(self, name: str, peer: str) -> None:
        self.future: Future[None] = Future()
        self.future.set_running_or_notify_cancel()
        self.id = next(_op_ids)
        self.name = name
        self.peer = peer
        self.remaining = 0
        self.lock = threading.Lock()
        # the zero-byte writes carrying the immediates of a multi-chunk op, posted after all its data landed
        self.imm_after: list[tuple[ProgressThread, Chunk]] = []

    def fail(self, exc: TransferError) -> bool:
        """Fail the op unless it is done already; True when this call failed it."""
        with self.lock:
            if self.future.done() or self.remaining < 0:
                return False
            self.remaining = -1
        self.future.set_exception(exc)
        return True

    def chunk_done(self) -> None:
        with self.lock:
            if self.remaining <= 0:
                return
            self.remaining -= 1
            if self.remaining:
                return
            after, self.imm_after = self.imm_after, []
            self.remaining = len(after)
        for thread, chunk in after:
            thread.submit([chunk])
        if not after and not self.future.done():
            self.future.set_result(None)

    @property
    def done(self) -> bool:
        return self.future.done()


@dataclass(slots=True)
class Chunk:
    """One posted piece of an op; its attributes are what Domain.post_batch reads."""

    op: Op
    kind: int
    ptr: int
    length: int
    desc: Any
    peer: int
    raddr: int
    key: int
    imm: int | None = None
    delivery_complete: bool = False
    keepalive: Any = None
    deadline: float = 0.0
    ctx: int = 0
    region: LocalRegion | None = None  # the local region this chunk reads into / writes from
    hash_job: int = 0  # the native digest job fed when this read lands (0: none)
    batch: WriteBatch | None = None  # write pieces the core gathers and posts, completed as this one chunk

    @property
    def group(self) -> int:
        """The op this chunk belongs to, for the core's cancellation of what is still queued."""
        return self.op.id


class Progress:
    """The progress threads of one engine (one per domain) and the op splitting that feeds them.

    on_imm(value, count) runs for the immediates of one batch of completions (count arrivals of
    value) and on_message(bytes) for every received message, both on a progress thread; they must
    not raise.
    """

    def __init__(
        self, domains: Sequence[Domain], *, label: str, timeout_s: float, chunk_bytes: int,
        delivery_complete: bool, reorder: bool, on_imm: Callable[[int, int], None],
        on_message: Callable[[bytes], None],
    ) -> None:
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self.reorder = reorder
        # Writes complete only once delivered (so a resolved write is visible to the peer). shm's
        # FI_DELIVERY_COMPLETE serialises ops (~2 ms each), so there only chunks followed by an imm
        # that are small enough to complete when queued (inject size) use it.
        self.delivery_complete = delivery_complete
        self.on_imm = on_imm
        self.on_message = on_message
        self.threads = [ProgressThread(self, f"rfork-transfer-{label}-{i}", d) for i, d in enumerate(domains)]
        self._rr = itertools.count()

    def start(self) -> None:
        for t in self.threads:
            t.start()
        self.threads[0].setup_recvs()

    def stop(self) -> None:
        """Stop every thread (outstanding ops fail with EngineClosed); nothing is posted afterwards.

        Waits up to 10 s for each drainer to finish (not for the one calling, if a callback closes
        the engine); close_domains then hands a domain whose drainer is still running to it."""
        for t in self.threads:
            t.stop()
        for t in self.threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=10)
                if t.is_alive():
                    log.warning("%s still running 10 s after stop; it closes its domain when it ends", t.name)

    def close_domains(self) -> None:
        """Close each domain now, or, where its drainer still runs, when the drainer ends (it may
        still deregister its receive buffers, so its domain must outlive it)."""
        for t in self.threads:
            t.close_domain_when_done()

    def submit(self, op: Op, parts: Sequence[Part]) -> Op:
        """Split the parts' spans into chunks over the domains and queue them; returns op.

        A part's writes go to each domain as batches (_batches): one chunk, one completion, for up
        to BATCH_PIECES pieces that the domain's core gathers into multi-iov writes. Reads, and a
        part of one piece, go as one chunk per piece, round-robin over the domains.
        An immediate rides on its part's data when that is the op's only piece and only immediate;
        otherwise immediates go as zero-byte writes once all the op's data landed.
        """
        nw = len(self.threads)
        start = next(self._rr)
        imms = [p for p in parts if p.imm is not None]
        planned = [(p, pieces) for p in parts if (pieces := cut_spans(p.spans, self.chunk_bytes))]
        count = sum(len(pieces) for _, pieces in planned)
        ride = count == 1 and len(imms) == 1 and planned[0][0] is imms[0]
        after = bool(imms) and not ride
        per_thread: list[list[Chunk]] = [[] for _ in range(nw)]
        j = 0
        for p, pieces in planned:
            region = p.region
            assert region is not None  # only an immediate alone has no data and no region
            if p.kind == WRITE and len(pieces) > 1:
                # contiguous blocks, one per domain, so that each domain can gather neighbours
                step = -(-len(pieces) // nw)
                for k in range(0, len(pieces), step):
                    w = (start + k // step) % nw
                    per_thread[w] += self._batches(op, p, region, w, pieces[k : k + step], after)
                continue
            for piece in pieces:
                w = (start + j) % nw
                j += 1
                per_thread[w].append(self._chunk(op, p, region, w, piece, ride, after))
        op.remaining = sum(len(chunks) for chunks in per_thread) or len(imms)
        if after:
            for i, p in enumerate(imms):
                w = (start + i) % nw
                key = p.keys[w % p.route.remote_domains]
                last = Chunk(op, WRITE, 0, 0, None, p.route.handles[w], p.base, key, imm=p.imm)
                if count:
                    op.imm_after.append((self.threads[w], last))
                else:
                    per_thread[w].append(last)
        if self.reorder:
            for chunks in per_thread:
                random.shuffle(chunks)
        for w, chunks in enumerate(per_thread):
            if chunks:
                self.threads[w].submit(chunks)
        if not count and not imms:
            op.future.set_result(None)
        return op

    def _chunk(
        self, op: Op, p: Part, region: LocalRegion, w: int, piece: tuple[int, int, int], ride: bool,
        after: bool,
    ) -> Chunk:
        """One posted read or write of one piece of the part on domain w."""
        lo, ro, n = piece
        small = after and n <= SHM_INJECT_BYTES
        dc = p.kind == WRITE and (self.delivery_complete or small)
        key = p.keys[w % p.route.remote_domains]
        return Chunk(op, p.kind, region.ptr + lo, n, region.regs[w].desc, p.route.handles[w], p.base + ro,
                     key, p.imm if ride else None, dc, region=region, hash_job=p.hash_job)

    def _batches(
        self, op: Op, p: Part, region: LocalRegion, w: int, pieces: list[tuple[int, int, int]], after: bool,
    ) -> list[Chunk]:
        """The part's write pieces for domain w as batches of up to BATCH_PIECES pieces and BATCH_BYTES:
        each batch is one chunk to Python (one submission, one pin, one completion record) while the
        core gathers its pieces into writes of up to the provider's iov limit and posts them. A
        page batch so costs Python little per page and the provider one op per gathered write.
        BATCH_BYTES keeps completions coming often enough for the per-peer progress deadline."""
        key = p.keys[w % p.route.remote_domains]
        # (reorder shuffles the batches, not the pieces within one: that would undo the gathering)
        # shm: a small write before an immediate must be delivery-complete (as in _chunk), and shm 1.17
        # does not complete multi-iov delivery-complete writes: small groups stay ungathered there
        small = 0 if self.delivery_complete else SHM_INJECT_BYTES
        dc_upto = small if after else 0
        ptr, base, csize = region.ptr, p.base, self.chunk_bytes
        out: list[Chunk] = []
        i = 0
        while i < len(pieces):
            flat, total, first = array("Q"), 0, pieces[i]
            end = min(len(pieces), i + BATCH_PIECES)
            while i < end and total < BATCH_BYTES:
                lo, ro, n = pieces[i]
                flat.extend((ptr + lo, base + ro, n))
                total += n
                i += 1
            if len(flat) == 3:
                out.append(self._chunk(op, p, region, w, first, False, after))
                continue
            batch = WriteBatch(flat, csize, ungathered_upto=small, dc_upto=dc_upto)
            out.append(Chunk(op, WRITE, ptr + first[0], total, region.regs[w].desc, p.route.handles[w],
                             base + first[1], key, None, self.delivery_complete, region=region, batch=batch))
        return out

    def send(self, route: Route, data: bytes) -> Future[None]:
        """Post data (<= MAX_MESSAGE bytes) as one two-sided message from domain 0."""
        buf = bytearray(data) or bytearray(1)
        ptr = _address(buf)
        op = Op("send", route.label)
        thread = self.threads[0]
        reg = thread.domain.register(ptr, len(buf), False, False)
        op.future.add_done_callback(lambda _f: thread.domain.deregister(reg))
        op.remaining = 1
        thread.submit([Chunk(op, SEND, ptr, len(data), reg.desc, route.handles[0], 0, 0, keepalive=buf)])
        return op.future


def _address(buf: bytearray) -> int:
    """The address of a bytearray's bytes (valid while it is alive and not resized)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class ProgressThread(threading.Thread):
    """The Python side of one domain's native progress core: hands chunks to it (any thread) and, on
    its own thread, resolves ops from the core's completion records in batches, re-posts receive
    buffers and enforces deadlines. The core (C, backends/providers/native/progress_core.c) alone posts
    and polls the endpoint; this thread waits for records in C, without the GIL."""

    def __init__(self, progress: Progress, name: str, domain: Domain) -> None:
        super().__init__(name=name, daemon=True)
        self.progress = progress
        self.domain = domain
        self._stop_flag = False
        self._lock = threading.Lock()  # guards _inflight: submitters add, this thread removes
        # submitted chunks not completed yet (queued in the core or posted), by context
        self._inflight: dict[int, Chunk] = {}
        # posted chunks whose op already failed (timeout): the provider may still complete them, so
        # they keep their region pinned until it does (or the engine closes)
        self._zombies: dict[int, Chunk] = {}
        self._recv_bufs: dict[int, tuple[bytearray, LocalRegistration]] = {}
        self._progress_at: dict[int, float] = {}  # peer -> last completion from it
        self._exit_lock = threading.Lock()  # orders this thread's end with close_domain_when_done
        self._ended = False
        self._close_domain_at_end = False

    def submit(self, chunks: Sequence[Chunk]) -> None:
        """Queue chunks in the native core (any thread); each pins its region until it completes."""
        deadline = time.monotonic() + self.progress.timeout_s
        with self._lock:
            for ch in chunks:
                ch.ctx = next(_ctx_ids)
                if ch.deadline == 0.0:
                    ch.deadline = deadline
                self._inflight[ch.ctx] = ch
        for ch in chunks:
            if ch.region is not None:
                ch.region.pin()
        try:
            self.domain.submit(chunks)
        except EngineClosed as exc:
            with self._lock:
                for ch in chunks:
                    self._inflight.pop(ch.ctx, None)
            for ch in chunks:
                if ch.region is not None:
                    ch.region.unpin()
                ch.op.fail(EngineClosed(f"{ch.op.name} with peer {ch.op.peer}: {exc}"))

    def start(self) -> None:
        self.domain.start_core()
        super().start()

    def stop(self) -> None:
        """Stop the native core (it posts nothing more); this thread ends once its records are drained."""
        self._stop_flag = True
        self.domain.stop_core()

    def setup_recvs(self) -> None:
        """Post the receive pool for two-sided messages (domain 0 only)."""
        for i in range(_RECV_COUNT):
            buf = bytearray(MAX_MESSAGE)
            reg = self.domain.register(_address(buf), MAX_MESSAGE, False, False)
            self._recv_bufs[_RECV_BASE + i] = (buf, reg)
            self._post_recv(_RECV_BASE + i)

    def _post_recv(self, ctx: int) -> None:
        buf, reg = self._recv_bufs[ctx]
        try:
            self.domain.post_recv(_address(buf), MAX_MESSAGE, reg.desc, ctx)
        except EngineClosed:
            log.debug("not re-posting receive buffer %d: the core stopped", ctx)

    def run(self) -> None:
        next_check = time.monotonic() + 0.02
        try:
            while True:
                comps = self.domain.drain(0.02)
                if comps is None:
                    break
                if comps:
                    self._handle(comps)
                now = time.monotonic()
                if now >= next_check:
                    self._check_deadlines(now)
                    next_check = now + 0.02
        except Exception:
            log.exception("progress thread %s crashed", self.name)
            self.domain.stop_core()
            self._fail_everything(TransferError(f"{self.name} crashed; see the log"))
        finally:
            self._fail_everything(EngineClosed("engine closed before the op completed"))
            self._release_recv_bufs()
            with self._exit_lock:
                self._ended = True
                close = self._close_domain_at_end
            if close:
                self.domain.close()

    def close_domain_when_done(self) -> None:
        """Close the domain now if this thread has ended (or never ran), else when it ends."""
        with self._exit_lock:
            if not self._ended and self.is_alive():
                self._close_domain_at_end = True
                return
        self._release_recv_bufs()  # a thread that never ran left them registered
        self.domain.close()

    def _release_recv_bufs(self) -> None:
        for _buf, reg in self._recv_bufs.values():
            try:
                self.domain.deregister(reg)
            except TransferError:
                log.debug("deregistering a receive buffer failed", exc_info=True)
        self._recv_bufs.clear()

    def _handle(self, comps: list[Completion]) -> None:
        inflight, progress_at = self._inflight, self._progress_at
        cq_data = self.domain.remote_cq_data_flag
        now = time.monotonic()
        with self._lock:
            chunks = [inflight.pop(c.context, None) for c in comps]
        imms: dict[int, int] = {}
        for c, ch in zip(comps, chunks, strict=True):
            if ch is not None:
                if ch.region is not None:
                    ch.region.unpin()
                if c.error:
                    self._fail_chunk(ch, c)
                else:
                    progress_at[ch.peer] = now
                    ch.op.chunk_done()
                continue
            ctx = c.context
            if ctx >= _RECV_BASE and ctx in self._recv_bufs:
                if not c.error:
                    self.progress.on_message(bytes(self._recv_bufs[ctx][0][: c.length]))
                if not self._stop_flag:
                    self._post_recv(ctx)
                continue
            zombie = self._zombies.pop(ctx, None) if self._zombies else None
            if zombie is not None:  # completed after its op timed out: now its memory may go
                if zombie.region is not None:
                    zombie.region.unpin()
                continue
            if c.flags & cq_data:
                imm = c.data & 0xFFFFFFFF
                imms[imm] = imms.get(imm, 0) + 1
            elif c.error:
                log.debug("completion error without context: %s", c.message)
            # else: already failed by a timeout; the late completion is dropped
        for imm, count in imms.items():  # immediates counted per batch of records
            self.progress.on_imm(imm, count)

    def _fail_chunk(self, ch: Chunk, c: Completion) -> None:
        err, message = c.error, c.message
        what = f"{ch.op.name} ({_OP_NAMES[ch.kind]} of {ch.length} bytes) with peer {ch.op.peer}"
        if c.flags & POST_FAILED:
            exc = TransferError(f"{ch.op.name} to {ch.op.peer}: {message}")
        elif err in _ACCESS_ERRNOS:
            exc = RemoteAccessError(f"{what} was refused: {message}")
        elif err == errno.ECANCELED and self._stop_flag:
            exc = EngineClosed(f"{what}: engine closed")
        else:
            exc = PeerUnreachable(f"{what} failed: {message}")
        if ch.op.fail(exc):
            # its chunks still queued in any domain's core need not go out any more
            for t in self.progress.threads:
                t.domain.cancel(group=ch.op.id)

    def _check_deadlines(self, now: float) -> None:
        timeout = self.progress.timeout_s
        progress_at = self._progress_at
        with self._lock:
            dead_peers = {
                ch.peer
                for ch in self._inflight.values()
                if ch.deadline < now and not ch.op.done and progress_at.get(ch.peer, 0.0) + timeout < now
            }
        if not dead_peers:
            return
        # Everything queued for a peer that stopped answering fails now rather than one timeout each.
        # Chunks still queued come back from the core as cancelled; posted ones stay posted: both
        # keep their region pinned (as zombies) until their record arrives.
        for peer in dead_peers:
            self.domain.cancel(peer=peer)
        with self._lock:
            victims = [(ctx, ch) for ctx, ch in self._inflight.items() if ch.peer in dead_peers]
            for ctx, ch in victims:
                del self._inflight[ctx]
                self._zombies[ctx] = ch
        for _ctx, ch in victims:
            self._timeout(ch)

    def _timeout(self, ch: Chunk) -> None:
        ch.op.fail(
            TransferTimeout(
                f"{ch.op.name} with peer {ch.op.peer} timed out after {self.progress.timeout_s:g}s "
                f"({_OP_NAMES[ch.kind]} of {ch.length} bytes not completed)"
            )
        )

    def _fail_everything(self, exc: TransferError) -> None:
        with self._lock:
            rest = list(self._inflight.values())
            self._inflight.clear()
        for ch in rest:
            ch.op.fail(exc)
        self._zombies.clear()  # the engine is closing: its endpoints go, so nothing lands any more
