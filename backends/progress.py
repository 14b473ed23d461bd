"""Progress threads: one per domain posts chunks, reaps completions and enforces deadlines.

An op (one engine call) is split into chunks of at most chunk_bytes, spread round-robin over the
domains. Only a domain's own thread touches its endpoint (posts, polls, waits), so the passive side
of a transfer keeps serving peers while its application sleeps, and any thread may submit. A
chunk's local region is pinned (`LocalRegion.pin`) while the chunk is posted: its memory outlives every
posted op, even one whose op already timed out. Future callbacks run on a progress thread.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from backends.errors import EngineClosed, PeerUnreachable, RemoteAccessError, TransferError, TransferTimeout
from backends.providers.domain import EAGAIN, Completion, Domain, LocalRegistration

log = logging.getLogger(__name__)

READ, WRITE, SEND = 0, 1, 2
_OP_NAMES = {READ: "read", WRITE: "write", SEND: "send"}
MAX_MESSAGE = 64 * 1024  # bytes of one two-sided message (the receive buffers' size)
# shm 1.17 completes writes up to its inject size when they are queued, not when they land; larger
# writes complete after the copy. Only those small ones need delivery-complete before an immediate.
SHM_INJECT_BYTES = 4096
_RECV_BASE = 1 << 48  # contexts of posted receive buffers
_RECV_COUNT = 16
_ACCESS_ERRNOS = {errno.EACCES, errno.EPERM, errno.EINVAL, errno.ENOKEY, errno.EKEYREJECTED, errno.EFAULT}
_ctx_ids = itertools.count(1)


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


class Op:
    """One user-visible op: a future and the count of chunks still outstanding."""

    __slots__ = ("future", "imm_after", "lock", "name", "peer", "remaining")

    def __init__(self, name: str, peer: str) -> None:
        self.future: Future[None] = Future()
        self.future.set_running_or_notify_cancel()
        self.name = name
        self.peer = peer
        self.remaining = 0
        self.lock = threading.Lock()
        # the zero-byte write carrying the imm of a multi-chunk write, posted after all its data landed
        self.imm_after: tuple[ProgressThread, Chunk] | None = None

    def fail(self, exc: TransferError) -> None:
        with self.lock:
            if self.future.done():
                return
            self.remaining = -1
        self.future.set_exception(exc)

    def chunk_done(self) -> None:
        with self.lock:
            if self.remaining <= 0:
                return
            self.remaining -= 1
            if self.remaining:
                return
            after, self.imm_after = self.imm_after, None
            if after is not None:
                self.remaining = 1
        if after is not None:
            after[0].submit([after[1]])
        elif not self.future.done():
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


class Progress:
    """The progress threads of one engine (one per domain) and the op splitting that feeds them.

    on_imm(value) runs for every arriving immediate and on_message(bytes) for every received
    message, both on a progress thread; they must not raise.
    """

    def __init__(
        self, domains: Sequence[Domain], *, label: str, timeout_s: float, chunk_bytes: int,
        delivery_complete: bool, reorder: bool, on_imm: Callable[[int], None],
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
        self.threads[0].setup_recvs()
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        """Stop every thread (outstanding ops fail with EngineClosed); nothing is posted afterwards."""
        for t in self.threads:
            t.stop()
        for t in self.threads:
            if t.is_alive():
                t.join(timeout=10)

    def submit(
        self, op: Op, route: Route, kind: int, region: LocalRegion | None,
        spans: Sequence[tuple[int, int, int]], base: int, keys: Sequence[int], imm: int | None,
    ) -> Future[None]:
        """Split (local_offset, remote_offset, length) spans into chunks over the domains; op's future.

        region is None only for an immediate alone; base and keys are the remote region's.
        """
        nw = len(self.threads)
        start = next(self._rr)
        csize = self.chunk_bytes
        pieces = [(lo + k, ro + k, min(csize, n - k)) for lo, ro, n in spans for k in range(0, n, csize)]
        per_thread: list[list[Chunk]] = [[] for _ in range(nw)]
        multi = len(pieces) > 1
        for j, (lo, ro, n) in enumerate(pieces):
            assert region is not None  # only an immediate alone has no data and no region
            w = (start + j) % nw
            small = multi and imm is not None and n <= SHM_INJECT_BYTES
            dc = kind == WRITE and (self.delivery_complete or small)
            key = keys[w % route.remote_domains]
            chunk = Chunk(op, kind, region.ptr + lo, n, region.regs[w].desc, route.handles[w], base + ro, key,
                          None if multi else imm, dc, region=region)
            per_thread[w].append(chunk)
        if imm is not None and (multi or not pieces):
            w = start % nw
            key = keys[w % route.remote_domains]
            last = Chunk(op, WRITE, 0, 0, None, route.handles[w], base, key, imm=imm)
            if pieces:
                op.imm_after = (self.threads[w], last)
            else:
                per_thread[w].append(last)
        op.remaining = len(pieces) if pieces else 1
        if self.reorder:
            for chunks in per_thread:
                random.shuffle(chunks)
        for w, chunks in enumerate(per_thread):
            if chunks:
                self.threads[w].submit(chunks)
        if not pieces and imm is None:
            op.future.set_result(None)
        return op.future

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
    """Progress thread for one domain: posts queued chunks, reaps completions, enforces timeouts."""

    def __init__(self, progress: Progress, name: str, domain: Domain) -> None:
        super().__init__(name=name, daemon=True)
        self.progress = progress
        self.domain = domain
        self._queue: deque[Chunk] = deque()
        self._qlock = threading.Lock()
        self._wake = threading.Event()
        self._sleeping = False
        self._stop_flag = False
        self._inflight: dict[int, Chunk] = {}
        # posted chunks whose op already failed (timeout): the provider may still complete them, so
        # they keep their region pinned until it does (or the engine closes)
        self._zombies: dict[int, Chunk] = {}
        self._pending: deque[Chunk] = deque()
        self._parked: list[Chunk] = []
        self._recv_bufs: dict[int, tuple[bytearray, LocalRegistration]] = {}
        self._progress_at: dict[int, float] = {}  # peer -> last completion from it

    def submit(self, chunks: Sequence[Chunk]) -> None:
        with self._qlock:
            self._queue.extend(chunks)
        # Wake the thread only when it sleeps: it sets _sleeping before its last look at the queue.
        if self._sleeping:
            self._wake.set()
            self.domain.signal()

    def stop(self) -> None:
        self._stop_flag = True
        self._wake.set()
        self.domain.signal()

    def setup_recvs(self) -> None:
        """Post the receive pool for two-sided messages (domain 0 only)."""
        for i in range(_RECV_COUNT):
            buf = bytearray(MAX_MESSAGE)
            reg = self.domain.register(_address(buf), MAX_MESSAGE, False, False)
            self._recv_bufs[_RECV_BASE + i] = (buf, reg)
            self._post_recv(_RECV_BASE + i)

    def _post_recv(self, ctx: int) -> None:
        buf, reg = self._recv_bufs[ctx]
        deadline = time.monotonic() + 5
        while self.domain.post_recv(_address(buf), MAX_MESSAGE, reg.desc, ctx) == EAGAIN:
            self._handle(self.domain.poll())
            if time.monotonic() > deadline:
                log.warning("could not repost receive buffer %d", ctx)
                return

    def run(self) -> None:
        idle = 0
        next_check = time.monotonic() + 0.02
        try:
            while not self._stop_flag:
                busy = self._handle(self.domain.poll())
                busy |= self._post_some()
                now = time.monotonic()
                if now >= next_check:
                    self._check_deadlines(now)
                    next_check = now + 0.02
                if busy:
                    idle = 0
                    continue
                idle += 1
                self._idle_wait(idle)
        except Exception:
            log.exception("progress thread %s crashed", self.name)
            self._fail_everything(TransferError(f"{self.name} crashed; see the log"))
        finally:
            self._fail_everything(EngineClosed("engine closed before the op completed"))
            for _buf, reg in self._recv_bufs.values():
                try:
                    self.domain.deregister(reg)
                except TransferError:
                    log.debug("deregistering a receive buffer failed", exc_info=True)
            self._recv_bufs.clear()

    def _idle_wait(self, idle: int) -> None:
        active = bool(self._inflight or self._pending or self._parked)
        if self.domain.can_wait:
            # Blocks on the provider's fds: wakes on traffic, a completion or signal().
            timeout = 0.002 if self._parked else (0.05 if not active else 0.01)
            self._sleeping = True
            try:
                if not self._queue:
                    self._handle(self.domain.wait(timeout))
            finally:
                self._sleeping = False
            return
        if active:
            time.sleep(0 if idle < 64 else 0.00005)
            return
        # Passive: poll often enough to serve peers' reads, sleep enough to leave the CPU to them.
        self._sleeping = True
        if not self._queue:
            self._wake.wait(min(0.0002, 0.00001 * idle))
        self._sleeping = False
        self._wake.clear()

    def _post_some(self) -> bool:
        if self._queue:
            with self._qlock:
                queued = list(self._queue)
                self._queue.clear()
            if self.progress.reorder:
                random.shuffle(queued)
            self._pending.extend(queued)
        posted = False
        limit = self.domain.max_inflight
        if self._parked:
            parked, self._parked = self._parked, []
            for ch in parked:
                if ch.op.done:
                    continue
                if len(self._inflight) >= limit or self._post(ch) == EAGAIN:
                    self._parked.append(ch)
                else:
                    posted = True
        pending, inflight = self._pending, self._inflight
        while pending and len(inflight) < limit:
            ch = pending[0]
            if ch.op.done:
                pending.popleft()
                continue
            if ch.kind == SEND:
                if self._post(ch) == EAGAIN:
                    if len(inflight) >= limit // 2:
                        break  # queue full: wait for completions
                    # Probably still connecting to this peer: park it, keep serving other peers.
                    self._parked.append(pending.popleft())
                    continue
                pending.popleft()
                posted = True
                continue
            # Reads and writes go to the provider as one batch (one native call).
            batch: list[Chunk] = []
            deadline = time.monotonic() + self.progress.timeout_s
            while pending and len(batch) < limit - len(inflight):
                ch = pending[0]
                if ch.kind == SEND:
                    break
                pending.popleft()
                if ch.op.done:
                    continue
                if ch.deadline == 0.0:
                    ch.deadline = deadline
                ch.ctx = next(_ctx_ids)
                batch.append(ch)
            if not batch:
                continue
            k, rc, message = self.domain.post_batch(batch)
            for ch in batch[:k]:
                inflight[ch.ctx] = ch
                if ch.region is not None:
                    ch.region.pin()
            posted = posted or k > 0
            if rc == 0:
                continue
            first, rest = batch[k], batch[k + 1 :]
            pending.extendleft(reversed(rest))
            if rc == EAGAIN:
                if len(inflight) >= limit // 2:
                    pending.appendleft(first)
                    break  # queue full: wait for completions
                self._parked.append(first)  # probably still connecting to this peer
                continue
            first.op.fail(TransferError(f"{first.op.name} to {first.op.peer}: {message}"))
        return posted

    def _post(self, ch: Chunk) -> int:
        if ch.deadline == 0.0:
            ch.deadline = time.monotonic() + self.progress.timeout_s
        ch.ctx = next(_ctx_ids)
        dom = self.domain
        try:
            if ch.kind == READ:
                rc = dom.post_read(ch.ptr, ch.length, ch.desc, ch.peer, ch.raddr, ch.key, ch.ctx)
            elif ch.kind == WRITE:
                rc = dom.post_write(ch.ptr, ch.length, ch.desc, ch.peer, ch.raddr, ch.key, ch.ctx, ch.imm,
                                    ch.delivery_complete)
            else:
                rc = dom.post_send(ch.ptr, ch.length, ch.desc, ch.peer, ch.ctx)
        except TransferError as exc:
            ch.op.fail(TransferError(f"{ch.op.name} to {ch.op.peer}: {exc}"))
            return 0
        if rc == 0:
            self._inflight[ch.ctx] = ch
            if ch.region is not None:
                ch.region.pin()
        return rc

    def _handle(self, comps: list[Completion]) -> bool:
        if not comps:
            return False
        inflight, progress_at = self._inflight, self._progress_at
        cq_data = self.domain.remote_cq_data_flag
        now = time.monotonic()
        for c in comps:
            ctx = c.context
            ch = inflight.pop(ctx, None)
            if ch is not None:
                if ch.region is not None:
                    ch.region.unpin()
                if c.error:
                    self._fail_chunk(ch, c.error, c.message)
                else:
                    progress_at[ch.peer] = now
                    ch.op.chunk_done()
                continue
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
                self.progress.on_imm(c.data & 0xFFFFFFFF)
            elif c.error:
                log.debug("completion error without context: %s", c.message)
            # else: already failed by a timeout; the late completion is dropped
        return True

    def _fail_chunk(self, ch: Chunk, err: int, message: str) -> None:
        what = f"{ch.op.name} ({_OP_NAMES[ch.kind]} of {ch.length} bytes) with peer {ch.op.peer}"
        if err in _ACCESS_ERRNOS:
            ch.op.fail(RemoteAccessError(f"{what} was refused: {message}"))
        elif err == errno.ECANCELED and self._stop_flag:
            ch.op.fail(EngineClosed(f"{what}: engine closed"))
        else:
            ch.op.fail(PeerUnreachable(f"{what} failed: {message}"))

    def _check_deadlines(self, now: float) -> None:
        timeout = self.progress.timeout_s
        expired = [
            ch
            for ch in itertools.chain(
                self._inflight.values(), self._parked, itertools.islice(self._pending, 0, 1)
            )
            if ch.deadline
            and ch.deadline < now
            and not ch.op.done
            and self._progress_at.get(ch.peer, 0.0) + timeout < now
        ]
        if not expired:
            return
        dead_peers = {ch.peer for ch in expired}
        # Everything queued for a peer that stopped answering fails now rather than one timeout each.
        for ctx, ch in list(self._inflight.items()):
            if ch.peer in dead_peers:
                del self._inflight[ctx]
                self._zombies[ctx] = ch  # still posted: keeps its region pinned until the provider is done
                self._timeout(ch)
        for ch in [*self._parked, *self._pending]:
            if ch.peer in dead_peers:
                self._timeout(ch)
        self._parked = [ch for ch in self._parked if ch.peer not in dead_peers]
        self._pending = deque(ch for ch in self._pending if ch.peer not in dead_peers)

    def _timeout(self, ch: Chunk) -> None:
        ch.op.fail(
            TransferTimeout(
                f"{ch.op.name} with peer {ch.op.peer} timed out after {self.progress.timeout_s:g}s "
                f"({_OP_NAMES[ch.kind]} of {ch.length} bytes not completed)"
            )
        )

    def _fail_everything(self, exc: TransferError) -> None:
        with self._qlock:
            rest = list(self._queue)
            self._queue.clear()
        for ch in itertools.chain(self._inflight.values(), self._parked, self._pending, rest):
            ch.op.fail(exc)
        self._zombies.clear()  # the engine is closing: its endpoints go, so nothing lands any more
        self._inflight.clear()
        self._parked.clear()
        self._pending.clear()
