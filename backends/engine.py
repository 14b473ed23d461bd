"""TransferEngine: one-sided reads/writes, immediates and small messages over a provider's domains.

Threads: one progress thread per domain owns that domain's endpoint (posts, polls, waits), so the
passive side of a transfer keeps serving peers while its application sleeps. Any thread may submit;
ops are split into chunks, sharded across domains, and a concurrent.futures.Future completes when
every chunk has. Future callbacks run on a progress thread: keep them short.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from backends.descriptor import ACCESS_NAMES, EngineAddress, MemoryRegionDescriptor
from backends.errors import (
    EngineClosed,
    PeerUnreachable,
    RemoteAccessError,
    TransferError,
    TransferTimeout,
)
from backends.imm import ImmCounter
from backends.lane import SHM_INJECT_BYTES, FastLane
from backends.providers._signals import preserved_signal_handlers
from backends.providers.domain import EAGAIN, Completion, Domain, LocalRegistration

log = logging.getLogger(__name__)

_READ, _WRITE, _SEND = 0, 1, 2
_OP_NAMES = {_READ: "read", _WRITE: "write", _SEND: "send"}
_RECV_BASE = 1 << 48  # contexts of posted receive buffers
_RECV_COUNT = 16
MAX_MESSAGE = 64 * 1024
_ACCESS_ERRNOS = {errno.EACCES, errno.EPERM, errno.EINVAL, errno.ENOKEY, errno.EKEYREJECTED, errno.EFAULT}
_ctx_ids = itertools.count(1)


class Region:
    """A registered buffer: local handles per domain plus the descriptor peers need to reach it."""

    def __init__(
        self,
        engine: TransferEngine,
        ptr: int,
        nbytes: int,
        access: str,
        regs: list[LocalRegistration],
        descriptor: MemoryRegionDescriptor,
        keepalive: Any,
    ) -> None:
        self.engine = engine
        self.ptr = ptr
        self.nbytes = nbytes
        self.access = access
        self.regs = regs
        self.descriptor = descriptor
        self._keepalive = keepalive
        self.closed = False
        # chunks posted to the provider and not yet completed (even if their op already failed): the
        # memory must stay registered and alive until this is 0 (see TransferEngine.deregister)
        self.posted = 0
        self.retiring = False

    def close(self) -> None:
        """Deregister (same as engine.deregister(region))."""
        self.engine.deregister(self)

    def __repr__(self) -> str:
        return f"Region(ptr={self.ptr:#x}, nbytes={self.nbytes}, access={self.access!r})"


class _Op:
    """One user-visible op: a future and the count of chunks still outstanding."""

    __slots__ = ("future", "imm_after", "lock", "name", "peer", "remaining")

    def __init__(self, name: str, peer: str) -> None:
        self.future: Future[None] = Future()
        self.future.set_running_or_notify_cancel()
        self.name = name
        self.peer = peer
        self.remaining = 0
        self.lock = threading.Lock()
        self.imm_after: _Chunk | None = None

    def fail(self, exc: TransferError) -> None:
        with self.lock:
            if self.future.done():
                return
            self.remaining = -1
        self.future.set_exception(exc)

    @property
    def done(self) -> bool:
        return self.future.done()


@dataclass(slots=True)
class _Chunk:
    op: _Op
    kind: int
    worker: int
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
    region: Region | None = None  # the local region this chunk reads into / writes from


@dataclass(slots=True)
class _Peer:
    label: str
    handles: list[int]  # per local domain
    remote_domains: int


class _Worker(threading.Thread):
    """Progress thread for one domain: posts queued chunks, reaps completions, enforces timeouts."""

    def __init__(self, engine: TransferEngine, index: int, domain: Domain) -> None:
        super().__init__(name=f"rfork-transfer-{engine.provider}-{index}", daemon=True)
        self.engine = engine
        self.index = index
        self.domain = domain
        self._queue: deque[_Chunk] = deque()
        self._qlock = threading.Lock()
        self._wake = threading.Event()
        self._sleeping = False
        self._stop_flag = False
        self._inflight: dict[int, _Chunk] = {}
        # posted chunks whose op already failed (timeout): the provider may still complete them, so
        # they keep their region alive until it does (or the engine closes)
        self._zombies: dict[int, _Chunk] = {}
        self._pending: deque[_Chunk] = deque()
        self._parked: list[_Chunk] = []
        self._recv_bufs: dict[int, tuple[bytearray, Any]] = {}
        self._progress_at: dict[int, float] = {}  # peer -> last completion from it

    def submit(self, chunks: Sequence[_Chunk]) -> None:
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
        from backends.providers._native import ffi  # local: only libfabric domains need it

        for i in range(_RECV_COUNT):
            buf = bytearray(MAX_MESSAGE)
            ptr = int(ffi.cast("uintptr_t", ffi.from_buffer(buf)))
            reg = self.domain.register(ptr, MAX_MESSAGE, False, False)
            self._recv_bufs[_RECV_BASE + i] = (buf, reg)
            self._post_recv(_RECV_BASE + i)

    def _post_recv(self, ctx: int) -> None:
        from backends.providers._native import ffi

        buf, reg = self._recv_bufs[ctx]
        ptr = int(ffi.cast("uintptr_t", ffi.from_buffer(buf)))
        deadline = time.monotonic() + 5
        while self.domain.post_recv(ptr, MAX_MESSAGE, reg.desc, ctx) == EAGAIN:
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
            for buf, reg in self._recv_bufs.values():
                del buf
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
            if idle < 64:
                time.sleep(0)
            else:
                time.sleep(0.00005)
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
            if self.engine.reorder_for_test:
                random.shuffle(queued)
            self._pending.extend(queued)
        posted = False
        dom = self.domain
        limit = dom.max_inflight
        if self._parked:
            parked, self._parked = self._parked, []
            for ch in parked:
                if ch.op.done:
                    continue
                if len(self._inflight) >= limit or self._post(ch) == EAGAIN:
                    self._parked.append(ch)
                else:
                    posted = True
        pending = self._pending
        inflight = self._inflight
        while pending and len(inflight) < limit:
            ch = pending[0]
            if ch.op.done:
                pending.popleft()
                continue
            if ch.kind == _SEND:
                rc = self._post(ch)
                if rc == EAGAIN:
                    if len(inflight) >= limit // 2:
                        break  # queue full: wait for completions
                    # Probably still connecting to this peer: park it, keep serving other peers.
                    self._parked.append(pending.popleft())
                    continue
                pending.popleft()
                posted = True
                continue
            # Reads and writes go to the provider as one batch (one native call).
            room = limit - len(inflight)
            batch: list[_Chunk] = []
            deadline = time.monotonic() + self.engine.timeout_s
            while pending and len(batch) < room:
                ch = pending[0]
                if ch.kind == _SEND:
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
            k, rc, message = dom.post_batch(batch)
            for ch in batch[:k]:
                inflight[ch.ctx] = ch
                self.engine._posted(ch)
            if k:
                posted = True
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

    def _post(self, ch: _Chunk) -> int:
        if ch.deadline == 0.0:
            ch.deadline = time.monotonic() + self.engine.timeout_s
        ch.ctx = next(_ctx_ids)
        dom = self.domain
        try:
            if ch.kind == _READ:
                rc = dom.post_read(ch.ptr, ch.length, ch.desc, ch.peer, ch.raddr, ch.key, ch.ctx)
            elif ch.kind == _WRITE:
                rc = dom.post_write(
                    ch.ptr,
                    ch.length,
                    ch.desc,
                    ch.peer,
                    ch.raddr,
                    ch.key,
                    ch.ctx,
                    ch.imm,
                    ch.delivery_complete,
                )
            else:
                rc = dom.post_send(ch.ptr, ch.length, ch.desc, ch.peer, ch.ctx)
        except TransferError as exc:
            ch.op.fail(TransferError(f"{ch.op.name} to {ch.op.peer}: {exc}"))
            return 0
        if rc == 0:
            self._inflight[ch.ctx] = ch
            self.engine._posted(ch)
        return rc

    def _handle(self, comps: list[Completion]) -> bool:
        if not comps:
            return False
        inflight = self._inflight
        cq_data = self.domain.remote_cq_data_flag
        chunk_done = self.engine._chunk_done
        progress_at = self._progress_at
        now = time.monotonic()
        for c in comps:
            ctx = c.context
            ch = inflight.pop(ctx, None)
            if ch is not None:
                self.engine._unposted(ch)
                if c.error:
                    self._fail_chunk(ch, c.error, c.message)
                else:
                    progress_at[ch.peer] = now
                    chunk_done(ch)
                continue
            if ctx >= _RECV_BASE and ctx in self._recv_bufs:
                if not c.error:
                    data = bytes(self._recv_bufs[ctx][0][: c.length])
                    self.engine._deliver_message(data)
                if not self._stop_flag:
                    self._post_recv(ctx)
                continue
            zombie = self._zombies.pop(ctx, None) if self._zombies else None
            if zombie is not None:  # completed after its op timed out: now its memory may go
                self.engine._unposted(zombie)
                continue
            if c.flags & cq_data:
                self.engine.imm.arrive(c.data & 0xFFFFFFFF)
            elif c.error:
                log.debug("completion error without context: %s", c.message)
            # else: already failed by a timeout; the late completion is dropped
        return True

    def _fail_chunk(self, ch: _Chunk, err: int, message: str) -> None:
        what = f"{ch.op.name} ({_OP_NAMES[ch.kind]} of {ch.length} bytes) with peer {ch.op.peer}"
        if err in _ACCESS_ERRNOS:
            ch.op.fail(RemoteAccessError(f"{what} was refused: {message}"))
        elif err == errno.ECANCELED and self._stop_flag:
            ch.op.fail(EngineClosed(f"{what}: engine closed"))
        else:
            ch.op.fail(PeerUnreachable(f"{what} failed: {message}"))

    def _check_deadlines(self, now: float) -> None:
        expired = [
            ch
            for ch in itertools.chain(
                self._inflight.values(), self._parked, itertools.islice(self._pending, 0, 1)
            )
            if ch.deadline
            and ch.deadline < now
            and not ch.op.done
            and self._progress_at.get(ch.peer, 0.0) + self.engine.timeout_s < now
        ]
        if not expired:
            return
        dead_peers = {ch.peer for ch in expired}
        # Everything queued for a peer that stopped answering fails now rather than one timeout each.
        for ctx, ch in list(self._inflight.items()):
            if ch.peer in dead_peers:
                del self._inflight[ctx]
                self._zombies[ctx] = ch  # still posted: keeps its region until the provider is done
                self._timeout(ch)
        for ch in [*self._parked, *self._pending]:
            if ch.peer in dead_peers:
                self._timeout(ch)
        self._parked = [ch for ch in self._parked if ch.peer not in dead_peers]
        self._pending = deque(ch for ch in self._pending if ch.peer not in dead_peers)

    def _timeout(self, ch: _Chunk) -> None:
        ch.op.fail(
            TransferTimeout(
                f"{ch.op.name} with peer {ch.op.peer} timed out after {self.engine.timeout_s:g}s "
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


class TransferEngine:
    """One-sided transfers over a libfabric provider; see docs/transport.md for the semantics.

    provider: "tcp" | "shm" | "efa" | "verbs" | "auto". domains: parallel endpoints (NICs).
    timeout_s bounds how long an op may wait on an unresponsive peer. chunk_bytes sets how large
    ops are split. reorder_for_test (or RFORK_REORDER_FOR_TEST=1) shuffles posts to prove that
    nothing depends on ordering. host pins tcp's source address (e.g. "127.0.0.1").
    """

    def __init__(
        self,
        provider: str = "tcp",
        domains: int = 1,
        *,
        timeout_s: float = 5.0,
        chunk_bytes: int = 1 << 20,
        reorder_for_test: bool | None = None,
        host: str | None = None,
    ) -> None:
        from backends.providers.libfabric import AUTO_ORDER, LibfabricDomain, provider_available

        if domains < 1:
            raise ValueError(f"domains must be >= 1, not {domains}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s}")
        if chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be >= 4096, not {chunk_bytes}")
        if host is None and provider in ("tcp", "auto"):
            host = os.environ.get("RFORK_TCP_HOST") or None
        if provider == "auto":
            provider = next((p for p in AUTO_ORDER if provider_available(p, host)), "tcp")
        self.provider = provider
        self.timeout_s = float(timeout_s)
        self.chunk_bytes = int(chunk_bytes)
        if reorder_for_test is None:
            reorder_for_test = os.environ.get("RFORK_REORDER_FOR_TEST", "") not in ("", "0")
        self.reorder_for_test = bool(reorder_for_test)
        self.imm = ImmCounter()
        # Writes complete only once delivered (so a resolved write is visible to the peer). shm's
        # FI_DELIVERY_COMPLETE serialises ops (~2 ms each here), so there only chunks followed by an
        # imm that are small enough to complete when queued (inject size) use it.
        self._delivery_complete = provider != "shm"
        self._lock = threading.Lock()
        self._closed = False
        self._regions: set[Region] = set()
        self._peers: dict[bytes, _Peer] = {}
        self._rr = itertools.count()
        self._on_message: Callable[[bytes], None] | None = None
        self._early_messages: list[bytes] = []
        self._domains: list[Domain] = []
        self._workers: list[_Worker] = []
        self._lanes: list[FastLane] = []
        self._host = host if provider == "tcp" else None
        try:
            with preserved_signal_handlers():  # libfabric may install its own SIGINT/SIGTERM handlers
                for _ in range(domains):
                    self._domains.append(LibfabricDomain(provider, host=host if provider == "tcp" else None))
            self.address = EngineAddress(provider, tuple(d.name for d in self._domains)).to_bytes()
            for i, dom in enumerate(self._domains):
                self._workers.append(_Worker(self, i, dom))
            self._workers[0].setup_recvs()
            for w in self._workers:
                w.start()
        except BaseException:
            self._shutdown()
            raise
        log.info("transfer engine open: provider=%s domains=%d", provider, domains)

    # ----- registration -------------------------------------------------------------------------
    def register(self, obj: Any, access: str = "rw") -> Region:
        """Register a torch CPU tensor, a writable buffer, or (ptr, nbytes) for the given remote access."""
        if access not in ACCESS_NAMES:
            raise ValueError(f"access must be one of {ACCESS_NAMES}, not {access!r}")
        self._check_open("register")
        ptr, nbytes, keepalive = _buffer_of(obj)
        if nbytes <= 0:
            raise TransferError(f"cannot register an empty buffer ({nbytes} bytes)")
        regs: list[LocalRegistration] = []
        try:
            for dom in self._domains:
                regs.append(dom.register(ptr, nbytes, access in ("read", "rw"), access in ("write", "rw")))
        except BaseException:
            for dom, reg in zip(self._domains, regs, strict=False):
                dom.deregister(reg)
            raise
        base = ptr if self._domains[0].mr_virt_addr else 0
        desc = MemoryRegionDescriptor(self.address, tuple(r.key for r in regs), base, nbytes, access, "host")
        region = Region(self, ptr, nbytes, access, regs, desc, keepalive)
        with self._lock:
            self._regions.add(region)
        return region

    def deregister(self, region: Region) -> None:
        """Release a region. New ops on it are refused at once; if chunks are still posted on it (even
        of ops that already failed, e.g. timed out), the registration and the memory (the region keeps
        the tensor alive) are released only when the provider has completed them, or at close(): no
        read ever lands in freed memory."""
        with self._lock:
            if region.closed:
                return
            region.closed = True
            if region.posted:
                region.retiring = True
                log.debug("deregistration of %r deferred: %d chunk(s) still posted", region, region.posted)
                return
            self._regions.discard(region)
        self._release(region)

    def _posted(self, ch: _Chunk) -> None:
        region = ch.region
        if region is not None:
            with self._lock:
                region.posted += 1

    def _unposted(self, ch: _Chunk) -> None:
        region = ch.region
        if region is None:
            return
        with self._lock:
            region.posted -= 1
            done = region.retiring and region.posted == 0
            if done:
                region.retiring = False
                self._regions.discard(region)
        if done:
            self._release(region)

    def _release(self, region: Region) -> None:
        for lane in list(self._lanes):
            lane._forget(region)
        for dom, reg in zip(self._domains, region.regs, strict=True):
            dom.deregister(reg)
        region.regs = []
        region._keepalive = None

    # ----- one-sided ops ------------------------------------------------------------------------
    def read(
        self,
        region: Region,
        offset: int,
        length: int,
        remote_desc: MemoryRegionDescriptor | bytes,
        remote_offset: int,
    ) -> Future[None]:
        """Read remote [remote_offset, +length) into region[offset, +length)."""
        rdesc = _desc(remote_desc)
        self._check_local(region, offset, length, "read")
        self._check_remote(rdesc, remote_offset, length, "read")
        op, peer = self._new_op("read", rdesc)
        return self._submit(op, peer, _READ, region, [(offset, remote_offset, length)], rdesc, None)

    def write(
        self,
        region: Region,
        offset: int,
        length: int,
        remote_desc: MemoryRegionDescriptor | bytes,
        remote_offset: int,
        imm: int | None = None,
    ) -> Future[None]:
        """Write region[offset, +length) to remote [remote_offset, +length); then deliver imm if given."""
        rdesc = _desc(remote_desc)
        _check_imm(imm)
        self._check_local(region, offset, length, "write")
        self._check_remote(rdesc, remote_offset, length, "write")
        op, peer = self._new_op("write", rdesc)
        return self._submit(op, peer, _WRITE, region, [(offset, remote_offset, length)], rdesc, imm)

    def write_paged(
        self,
        region: Region,
        src_pages: Sequence[int],
        src_stride: int,
        remote_desc: MemoryRegionDescriptor | bytes,
        dst_pages: Sequence[int],
        dst_stride: int,
        page_len: int,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: int | None = None,
    ) -> Future[None]:
        """Write page src_pages[i] (at src_offset + p*src_stride) to dst_pages[i] (dst_offset + p*dst_stride).

        Adjacent pages on both sides are merged into one transfer; imm (if any) arrives once, after all.
        """
        rdesc = _desc(remote_desc)
        _check_imm(imm)
        if len(src_pages) != len(dst_pages):
            raise ValueError(
                f"write_paged: {len(src_pages)} source pages but {len(dst_pages)} destination pages"
            )
        if page_len < 0 or src_stride < 0 or dst_stride < 0:
            raise ValueError("write_paged: page_len and strides must be non-negative")
        spans: list[tuple[int, int, int]] = []
        src_pages = [int(p) for p in src_pages]
        dst_pages = [int(p) for p in dst_pages]
        if src_pages:
            # Offsets grow with the page index, so checking the extremes checks every page.
            lo_s, hi_s, lo_d, hi_d = min(src_pages), max(src_pages), min(dst_pages), max(dst_pages)
            if lo_s < 0 or lo_d < 0:
                raise RemoteAccessError(f"write_paged: negative page index ({lo_s}, {lo_d})")
            for sp in (lo_s, hi_s):
                self._check_local(region, src_offset + sp * src_stride, page_len, "write_paged")
            for dp in (lo_d, hi_d):
                self._check_remote(rdesc, dst_offset + dp * dst_stride, page_len, "write_paged")
        if page_len:
            end_s = end_d = -1
            start_s = start_d = 0
            for sp, dp in zip(src_pages, dst_pages, strict=True):
                so, do = src_offset + sp * src_stride, dst_offset + dp * dst_stride
                if so == end_s and do == end_d:
                    end_s += page_len
                    end_d += page_len
                    continue
                if end_s >= 0:
                    spans.append((start_s, start_d, end_s - start_s))
                start_s, start_d, end_s, end_d = so, do, so + page_len, do + page_len
            if end_s >= 0:
                spans.append((start_s, start_d, end_s - start_s))
        op, peer = self._new_op("write_paged", rdesc)
        return self._submit(op, peer, _WRITE, region, spans, rdesc, imm)

    def write_spans(
        self,
        region: Region,
        spans: Sequence[tuple[int, int, int]],
        remote_desc: MemoryRegionDescriptor | bytes,
        imm: int | None = None,
    ) -> Future[None]:
        """Write many (local_offset, remote_offset, length) spans into one remote region: one future.

        The batched form of write(): one call, one future for all spans; imm (if any) arrives once,
        after every span landed. Spans are not merged or reordered here (write_paged merges pages).
        """
        rdesc = _desc(remote_desc)
        _check_imm(imm)
        checked: list[tuple[int, int, int]] = []
        for lo, ro, n in spans:
            self._check_local(region, lo, n, "write_spans")
            self._check_remote(rdesc, ro, n, "write_spans")
            if n:
                checked.append((int(lo), int(ro), int(n)))
        op, peer = self._new_op("write_spans", rdesc)
        return self._submit(op, peer, _WRITE, region, checked, rdesc, imm)

    def open_lane(self) -> FastLane:
        """A caller-driven endpoint for small ops and batches, owned by the calling thread (backends.lane)."""
        from backends.providers.libfabric import LibfabricDomain

        self._check_open("open_lane")
        lane = FastLane(self, LibfabricDomain(self.provider, host=self._host))
        with self._lock:
            self._lanes.append(lane)
        return lane

    def _forget_lane(self, lane: FastLane) -> None:
        with self._lock:
            if lane in self._lanes:
                self._lanes.remove(lane)

    def write_imm(self, imm: int, remote_desc: MemoryRegionDescriptor | bytes) -> Future[None]:
        """Deliver an immediate with no payload to the region's owner (needs write access)."""
        rdesc = _desc(remote_desc)
        _check_imm(imm)
        self._check_remote(rdesc, 0, 0, "write_imm")
        op, peer = self._new_op("write_imm", rdesc)
        return self._submit(op, peer, _WRITE, None, [], rdesc, imm)

    def expect(self, imm: int, count: int = 1) -> Future[None]:
        """Future resolved once `count` writes carrying imm have arrived here (since engine open)."""
        self._check_open("expect")
        return self.imm.expect(imm, count)

    # ----- two-sided messages -------------------------------------------------------------------
    def send(self, peer_address: bytes, data: bytes) -> Future[None]:
        """Send a small control message (<= 64 KiB) to another engine's on_message callback."""
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"send: {len(data)} bytes exceeds the {MAX_MESSAGE}-byte message limit")
        from backends.providers._native import ffi

        buf = bytearray(data) or bytearray(1)
        ptr = int(ffi.cast("uintptr_t", ffi.from_buffer(buf)))
        peer = self._peer(peer_address)
        op = _Op("send", peer.label)
        dom = self._domains[0]
        reg = dom.register(ptr, len(buf), False, False)
        op.future.add_done_callback(lambda _f: dom.deregister(reg))
        op.remaining = 1
        self._workers[0].submit(
            [_Chunk(op, _SEND, 0, ptr, len(data), reg.desc, peer.handles[0], 0, 0, keepalive=buf)]
        )
        return op.future

    def on_message(self, callback: Callable[[bytes], None]) -> None:
        """Set the receive callback (runs on a progress thread); earlier messages are delivered now."""
        with self._lock:
            self._on_message = callback
            early, self._early_messages = self._early_messages, []
        for data in early:
            self._call_message(callback, data)

    def _deliver_message(self, data: bytes) -> None:
        with self._lock:
            cb = self._on_message
            if cb is None:
                self._early_messages.append(data)
                return
        self._call_message(cb, data)

    @staticmethod
    def _call_message(cb: Callable[[bytes], None], data: bytes) -> None:
        try:
            cb(data)
        except Exception:
            log.exception("on_message callback raised")

    # ----- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop progress threads, fail outstanding futures, release registrations and endpoints."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._shutdown()

    def _shutdown(self) -> None:
        self._closed = True
        for w in self._workers:
            w.stop()
        for w in self._workers:
            if w.is_alive():
                w.join(timeout=10)
        for lane in list(getattr(self, "_lanes", ())):
            lane.close()  # after the progress threads: no provider call runs beside the close
        self.imm.fail_all(EngineClosed("engine closed"))
        for region in list(self._regions):  # progress threads are gone: nothing is posted any more
            region.posted = 0
            region.closed = False
            self.deregister(region)
        for dom in self._domains:
            dom.close()
        self._domains = []
        self._workers = []

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def domains(self) -> int:
        """Number of domains (parallel endpoints)."""
        return len(self._domains)

    # ----- internals ----------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise EngineClosed(f"{what}: engine is closed")

    def _check_local(self, region: Region, offset: int, length: int, op: str) -> None:
        self._check_open(op)
        if region.engine is not self or region.closed:
            raise TransferError(f"{op}: local region is deregistered or belongs to another engine")
        if offset < 0 or length < 0 or offset + length > region.nbytes:
            raise RemoteAccessError(
                f"{op}: local range [{offset}, {offset + length}) is outside the {region.nbytes}-byte region"
            )

    def _check_remote(self, desc: MemoryRegionDescriptor, offset: int, length: int, op: str) -> None:
        need_read = op == "read"
        if need_read and not desc.readable:
            raise RemoteAccessError(f"{op}: remote region grants {desc.access!r} access, not read")
        if not need_read and not desc.writable:
            raise RemoteAccessError(f"{op}: remote region grants {desc.access!r} access, not write")
        if offset < 0 or length < 0 or offset + length > desc.length:
            raise RemoteAccessError(
                f"{op}: remote range [{offset}, {offset + length}) is outside the {desc.length}-byte region"
            )

    def _peer(self, address: bytes) -> _Peer:
        self._check_open("connect")
        peer = self._peers.get(address)
        if peer is not None:
            return peer
        ea = EngineAddress.from_bytes(address)
        if ea.provider != self.provider:
            raise TransferError(f"peer uses provider {ea.provider!r}, this engine {self.provider!r}")
        n = len(ea.domains)
        handles = [dom.insert_peer(ea.domains[i % n]) for i, dom in enumerate(self._domains)]
        peer = _Peer(f"{self.provider}:{self._domains[0].straddr(ea.domains[0])}", handles, n)
        with self._lock:
            self._peers.setdefault(address, peer)
        return peer

    def _new_op(self, name: str, desc: MemoryRegionDescriptor) -> tuple[_Op, _Peer]:
        peer = self._peer(desc.address)
        if len(desc.keys) != peer.remote_domains:
            raise TransferError(f"{name}: descriptor has {len(desc.keys)} keys for a different domain count")
        return _Op(name, peer.label), peer

    def _submit(
        self,
        op: _Op,
        peer: _Peer,
        kind: int,
        region: Region | None,
        spans: list[tuple[int, int, int]],
        desc: MemoryRegionDescriptor,
        imm: int | None,
    ) -> Future[None]:
        nw = len(self._workers)
        start = next(self._rr)
        csize = self.chunk_bytes
        pieces: list[tuple[int, int, int]] = []
        for lo, ro, n in spans:
            for k in range(0, n, csize):
                pieces.append((lo + k, ro + k, min(csize, n - k)))
        per_worker: list[list[_Chunk]] = [[] for _ in range(nw)]
        multi = len(pieces) > 1
        for j, (lo, ro, n) in enumerate(pieces):
            w = (start + j) % nw
            rd = w % peer.remote_domains
            assert region is not None
            per_worker[w].append(
                _Chunk(
                    op,
                    kind,
                    w,
                    region.ptr + lo,
                    n,
                    region.regs[w].desc,
                    peer.handles[w],
                    desc.base + ro,
                    desc.keys[rd],
                    imm=None if multi else imm,
                    delivery_complete=kind == _WRITE
                    and (self._delivery_complete or (multi and imm is not None and n <= SHM_INJECT_BYTES)),
                    region=region,
                )
            )
        if imm is not None and (multi or not pieces):
            w = start % nw
            last = _Chunk(
                op,
                _WRITE,
                w,
                0,
                0,
                None,
                peer.handles[w],
                desc.base,
                desc.keys[w % peer.remote_domains],
                imm=imm,
            )
            if pieces:
                op.imm_after = last
            else:
                per_worker[w].append(last)
        op.remaining = len(pieces) if pieces else 1
        if self.reorder_for_test:
            for chunks in per_worker:
                random.shuffle(chunks)
        for w, chunks in enumerate(per_worker):
            if chunks:
                self._workers[w].submit(chunks)
        if not pieces and imm is None:
            op.future.set_result(None)
        return op.future

    def _chunk_done(self, ch: _Chunk) -> None:
        op = ch.op
        with op.lock:
            if op.remaining <= 0:
                return
            op.remaining -= 1
            if op.remaining:
                return
            after, op.imm_after = op.imm_after, None
            if after is not None:
                op.remaining = 1
        if after is not None:
            self._workers[after.worker].submit([after])
        elif not op.future.done():
            op.future.set_result(None)


def _desc(d: MemoryRegionDescriptor | bytes) -> MemoryRegionDescriptor:
    return d if isinstance(d, MemoryRegionDescriptor) else MemoryRegionDescriptor.from_bytes(d)


def _check_imm(imm: int | None) -> None:
    if imm is not None and not 0 <= imm < 2**32:
        raise ValueError(f"imm {imm} is not a 32-bit unsigned value")


def _buffer_of(obj: Any) -> tuple[int, int, Any]:
    """(ptr, nbytes, object to keep alive) for a tensor, a buffer or a (ptr, nbytes) pair."""
    if isinstance(obj, tuple):
        ptr, nbytes = obj
        return int(ptr), int(nbytes), None
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):
        if obj.device.type != "cpu":
            raise TransferError(
                f"register: {obj.device.type} tensors are not supported yet (host memory only)"
            )
        if not obj.is_contiguous():
            raise TransferError("register: tensor is not contiguous")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), obj
    from backends.providers._native import ffi

    try:
        cbuf = ffi.from_buffer(obj, require_writable=False)
    except TypeError as exc:
        raise TransferError(
            f"register: {type(obj).__name__} is not a tensor, buffer or (ptr, nbytes)"
        ) from exc
    return int(ffi.cast("uintptr_t", cbuf)), len(cbuf), (obj, cbuf)
