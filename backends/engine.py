"""TransferEngine: the transport's public API; docs/transport.md has the semantics.

Regions are registered here, every op is checked here before anything is posted (the check
functions below are shared with cuda_ipc and staging) into `Part`s, and started as one op on the
progress cores (backends.progress: a native thread per domain alone touches its endpoint). Every op
takes that one path: the methods below and the lane's batches (backends.lane) alike. Paths share an
engine through channels (backends.channel); other code learns of region releases and of close
through `add_hooks`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from backends.channel import Channel, ChannelHub
from backends.checks import check_local, check_remote
from backends.checks import check_range as check_range  # re-exported: the engine's callers import it here
from backends.descriptor import ACCESS_NAMES, EngineAddress, MemoryRegionDescriptor
from backends.digest_job import DigestJob
from backends.errors import EngineClosed, RemoteAccessError, TransferError
from backends.imm import ImmCounter
from backends.progress import MAX_MESSAGE, READ, WRITE, Op, Part, Progress, Route
from backends.providers import registry
from backends.providers._native import buffer_address
from backends.providers.domain import Domain, LocalRegistration
from backends.spans import page_spans

log = logging.getLogger(__name__)


# The range and access checks every op passes before anything is posted are in backends.checks
# (cuda_ipc uses them without the libfabric binding), imported above for the engine and its callers.


def check_imm(imm: int | None) -> None:
    """ValueError unless imm is None or a 32-bit unsigned value."""
    if imm is not None and not 0 <= imm < 2**32:
        raise ValueError(f"imm {imm} is not a 32-bit unsigned value")


def as_descriptor(desc: MemoryRegionDescriptor | bytes) -> MemoryRegionDescriptor:
    """A descriptor from itself or its bytes (TransferError on garbage)."""
    return desc if isinstance(desc, MemoryRegionDescriptor) else MemoryRegionDescriptor.from_bytes(desc)


class Region:
    """A registered buffer: local handles per domain plus the descriptor peers need to reach it.

    `posted` counts chunks at the provider that read into or write from it (even of ops that already
    failed): the registration and the memory stay until it is 0 (see TransferEngine.deregister).
    """

    def __init__(
        self, engine: TransferEngine, ptr: int, nbytes: int, access: str, regs: list[LocalRegistration],
        descriptor: MemoryRegionDescriptor, keepalive: Any,
    ) -> None:
        self.engine = engine
        self.ptr = ptr
        self.nbytes = nbytes
        self.access = access
        self.regs = regs
        self.descriptor = descriptor
        self._keepalive = keepalive
        self.closed = False
        self.posted = 0
        self.retiring = False

    def pin(self) -> None:
        """One more chunk posted on this region (progress thread)."""
        with self.engine._lock:
            self.posted += 1

    def unpin(self) -> None:
        """A posted chunk completed; a deregistered region is released with its last one."""
        with self.engine._lock:
            self.posted -= 1
            release = self.retiring and self.posted == 0
            if release:
                self.retiring = False
                self.engine._regions.discard(self)
        if release:
            self.engine._release(self)

    def close(self) -> None:
        """Deregister (same as engine.deregister(region))."""
        self.engine.deregister(self)

    def __repr__(self) -> str:
        return f"Region(ptr={self.ptr:#x}, nbytes={self.nbytes}, access={self.access!r})"


class TransferEngine:
    """One-sided transfers over a provider; see docs/transport.md for the semantics.

    provider: a name in backends.providers.registry ("tcp" | "shm" | "efa" | "verbs") or "auto"
    (BackendUnavailable naming the known ones for any other). domains: parallel endpoints (NICs).
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
        if domains < 1:
            raise ValueError(f"domains must be >= 1, not {domains}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s}")
        if chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be >= 4096, not {chunk_bytes}")
        if host is None:  # used only where the chosen row binds a source address (tcp)
            host = os.environ.get("RFORK_TCP_HOST") or None
        chosen = registry.choose(provider, host)
        provider = chosen.name
        if reorder_for_test is None:
            reorder_for_test = os.environ.get("RFORK_REORDER_FOR_TEST", "") not in ("", "0")
        self.provider = provider
        self.timeout_s = float(timeout_s)
        self.chunk_bytes = int(chunk_bytes)
        self.reorder_for_test = bool(reorder_for_test)
        self._host = host if chosen.binds_host else None
        self._lock = threading.Lock()
        self._closed = False
        self._regions: set[Region] = set()
        self._routes: dict[bytes, Route] = {}
        self._imm: ImmCounter | None = None  # both made on first use: a plain read never needs them
        self._channels: ChannelHub | None = None
        # (on_release, on_close) of caller-driven endpoints
        self._hooks: list[tuple[Callable[[Region], None] | None, Callable[[], None] | None]] = []
        self._domains: list[Domain] = []
        self._progress: Progress | None = None
        try:
            self._domains = registry.open_domains(chosen, domains, host=self._host)
            self.address = EngineAddress(provider, tuple(d.name for d in self._domains)).to_bytes()
            self._progress = Progress(
                self._domains, label=provider, timeout_s=self.timeout_s, chunk_bytes=self.chunk_bytes,
                delivery_complete=chosen.delivery_complete, reorder=self.reorder_for_test,
                on_imm=lambda imm, n: self.imm.arrive(imm, n), on_message=self._on_frame,
            )
            self._progress.start()
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

    def _release(self, region: Region) -> None:
        for on_release, _ in list(self._hooks):
            if on_release is not None:
                on_release(region)
        for dom, reg in zip(self._domains, region.regs, strict=True):
            dom.deregister(reg)
        region.regs = []
        region._keepalive = None

    def add_hooks(
        self, *, on_release: Callable[[Region], None] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> Callable[[], None]:
        """Call on_release(region) as each region is released (any thread) and on_close() once at close
        (after the progress threads stopped, before the regions go); returns the unsubscribe function."""
        hooks = (on_release, on_close)
        with self._lock:
            self._hooks.append(hooks)

        def unsubscribe() -> None:
            with self._lock:
                if hooks in self._hooks:
                    self._hooks.remove(hooks)

        return unsubscribe

    # ----- one-sided ops ------------------------------------------------------------------------
    def read(self, region: Region, offset: int, length: int, remote_desc: MemoryRegionDescriptor | bytes,
             remote_offset: int, *, digest: DigestJob | None = None) -> Future[None]:
        """Read remote [remote_offset, +length) into region[offset, +length); with `digest`, its core
        thread feeds the landed bytes to that job (backends.digest_job) before the future resolves."""
        part = self.read_part(region, offset, length, remote_desc, remote_offset, digest=digest)
        return self.start_op("read", [part]).future

    def write(self, region: Region, offset: int, length: int, remote_desc: MemoryRegionDescriptor | bytes,
              remote_offset: int, imm: int | None = None) -> Future[None]:
        """Write region[offset, +length) to remote [remote_offset, +length); then deliver imm if given."""
        part = self.write_part(region, [(offset, remote_offset, length)], remote_desc, imm, what="write")
        return self.start_op("write", [part]).future

    def write_paged(
        self, region: Region, src_pages: Sequence[int], src_stride: int,
        remote_desc: MemoryRegionDescriptor | bytes, dst_pages: Sequence[int], dst_stride: int, page_len: int,
        src_offset: int = 0, dst_offset: int = 0, imm: int | None = None,
    ) -> Future[None]:
        """Write page src_pages[i] (at src_offset + p*src_stride) to dst_pages[i] (dst_offset + p*dst_stride).

        Adjacent pages on both sides are merged into one transfer; imm (if any) arrives once, after all.
        """
        rdesc = as_descriptor(remote_desc)
        check_imm(imm)
        if len(src_pages) != len(dst_pages):
            raise ValueError(
                f"write_paged: {len(src_pages)} source pages but {len(dst_pages)} destination pages"
            )
        if page_len < 0 or src_stride < 0 or dst_stride < 0:
            raise ValueError("write_paged: page_len and strides must be non-negative")
        src_pages, dst_pages = [int(p) for p in src_pages], [int(p) for p in dst_pages]
        if src_pages:
            # Offsets grow with the page index, so checking the extremes checks every page.
            lo_s, hi_s, lo_d, hi_d = min(src_pages), max(src_pages), min(dst_pages), max(dst_pages)
            if lo_s < 0 or lo_d < 0:
                raise RemoteAccessError(f"write_paged: negative page index ({lo_s}, {lo_d})")
            for sp in (lo_s, hi_s):
                check_local(self, region, src_offset + sp * src_stride, page_len, "write_paged")
            for dp in (lo_d, hi_d):
                check_remote(rdesc, dst_offset + dp * dst_stride, page_len, "write_paged", need="write")
        spans = page_spans(src_pages, src_offset, src_stride, dst_pages, dst_offset, dst_stride, page_len)
        return self.start_op("write_paged", [self._part(WRITE, region, spans, rdesc, imm)]).future

    def write_spans(
        self, region: Region, spans: Sequence[tuple[int, int, int]],
        remote_desc: MemoryRegionDescriptor | bytes, imm: int | None = None,
    ) -> Future[None]:
        """Write many (local_offset, remote_offset, length) spans into one remote region: one future.

        The batched form of write(): one call, one future for all spans; imm (if any) arrives once,
        after every span landed. Spans are not merged or reordered here (write_paged merges pages).
        """
        return self.start_op("write_spans", [self.write_part(region, spans, remote_desc, imm)]).future

    def write_imm(self, imm: int, remote_desc: MemoryRegionDescriptor | bytes) -> Future[None]:
        """Deliver an immediate with no payload to the region's owner (needs write access)."""
        return self.start_op("write_imm", [self.imm_part(imm, remote_desc)]).future

    # ----- the one op path (the methods above and backends.lane's batches) ----------------------
    def read_part(
        self, region: Region, offset: int, length: int, remote_desc: MemoryRegionDescriptor | bytes,
        remote_offset: int, *, what: str = "read", digest: DigestJob | None = None,
    ) -> Part:
        """A checked read of remote [remote_offset, +length) into region[offset, +length), for start_op."""
        rdesc = as_descriptor(remote_desc)
        check_local(self, region, offset, length, what)
        check_remote(rdesc, remote_offset, length, what, need="read")
        spans = [(int(offset), int(remote_offset), int(length))]
        return self._part(READ, region, spans, rdesc, None, 0 if digest is None else digest.address)

    def write_part(
        self, region: Region, spans: Sequence[tuple[int, int, int]],
        remote_desc: MemoryRegionDescriptor | bytes, imm: int | None = None, *, what: str = "write_spans",
    ) -> Part:
        """Checked writes of (local_offset, remote_offset, length) spans into one remote region, then
        imm (if any), for start_op."""
        rdesc = as_descriptor(remote_desc)
        check_imm(imm)
        check_local(self, region, 0, 0, what)  # the engine, the region and the access, once
        check_remote(rdesc, 0, 0, what, need="write")
        lsize, rsize = region.nbytes, rdesc.length
        checked: list[tuple[int, int, int]] = []
        for lo, ro, n in spans:  # a page batch has thousands of spans: only the bounds, per span
            if lo < 0 or ro < 0 or n < 0 or lo + n > lsize or ro + n > rsize:
                check_range(what, "local", lo, n, lsize)
                check_range(what, "remote", ro, n, rsize)
            if n:
                checked.append((int(lo), int(ro), int(n)))
        return self._part(WRITE, region, checked, rdesc, imm)

    def imm_part(
        self, imm: int, remote_desc: MemoryRegionDescriptor | bytes, *, what: str = "write_imm"
    ) -> Part:
        """A checked immediate with no payload for the remote region's owner, for start_op."""
        rdesc = as_descriptor(remote_desc)
        check_imm(imm)
        check_remote(rdesc, 0, 0, what, need="write")
        return self._part(WRITE, None, [], rdesc, imm)

    def start_op(self, name: str, parts: Sequence[Part]) -> Op:
        """Post checked parts as one op: its future resolves once every part's data (and then every
        immediate) completed, or fails with the first error, naming `name` and the peer."""
        self._check_open(name)
        assert self._progress is not None
        label = ", ".join(sorted({p.route.label for p in parts})) or "no peer"
        return self._progress.submit(Op(name, label), parts)

    def _part(
        self, kind: int, region: Region | None, spans: Sequence[tuple[int, int, int]],
        desc: MemoryRegionDescriptor, imm: int | None, hash_job: int = 0,
    ) -> Part:
        route = self._route(desc.address)
        if len(desc.keys) != route.remote_domains:
            raise TransferError(f"descriptor has {len(desc.keys)} keys for a different domain count")
        return Part(kind, region, spans, route, desc.base, desc.keys, imm, hash_job)

    @property
    def imm(self) -> ImmCounter:
        """The counter of arrived immediates (it counts every one from engine open)."""
        if self._imm is None:
            with self._lock:
                if self._imm is None:
                    self._imm = ImmCounter()
        return self._imm

    def expect(self, imm: int, count: int = 1) -> Future[None]:
        """Future resolved once `count` writes carrying imm have arrived here (since engine open)."""
        self._check_open("expect")
        return self.imm.expect(imm, count)

    # ----- two-sided messages -------------------------------------------------------------------
    def channel(self, name: str, *, imms: int = 0, key: bytes | None = None) -> Channel:
        """Open the channel `name` with `imms` private immediate values and, optionally, a set-up key
        every frame on it must carry (backends.channel)."""
        self._check_open("channel")
        return self._hub().open(name, imms, key)

    def send(self, peer_address: bytes, frame: bytes) -> Future[None]:
        """Send one frame (<= MAX_MESSAGE bytes) to a peer engine. Paths use Channel.send, which seals
        the frame (backends.peer_auth); the peer routes frames by channel and drops (and counts) the
        rest."""
        if len(frame) > MAX_MESSAGE:
            raise ValueError(f"send: {len(frame)} bytes exceeds the {MAX_MESSAGE}-byte message limit")
        route = self._route(peer_address)
        assert self._progress is not None
        return self._progress.send(route, frame)

    @property
    def frames_dropped(self) -> dict[str, int]:
        """Received frames dropped so far, by reason: malformed, forged, replayed, foreign
        (backends.peer_auth), for a closed channel, or over the early limits."""
        return dict(self._hub().dropped)

    def _hub(self) -> ChannelHub:
        if self._channels is None:
            with self._lock:
                if self._channels is None:
                    self._channels = ChannelHub(self)
        return self._channels

    def _on_frame(self, frame: bytes) -> None:
        self._hub().deliver(frame)

    # ----- lifecycle ----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True once close() began."""
        return self._closed

    @property
    def domains(self) -> int:
        """Number of domains (parallel endpoints)."""
        return len(self._domains)

    def outstanding(self) -> int:
        """Chunks at the provider that read into or write from this engine's regions, counting those of
        ops that already failed (a timed-out read still lands if its peer wakes up). 0 means no posted
        op can change local memory any more; close() is the way to make it 0 without waiting."""
        with self._lock:
            return sum(region.posted for region in self._regions)

    def close(self) -> None:
        """Stop progress threads, fail outstanding futures, release registrations and endpoints."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._shutdown()

    def _shutdown(self) -> None:
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
        for _, on_close in list(self._hooks):  # no provider call of ours runs beside them any more
            try:
                if on_close is not None:
                    on_close()
            except Exception:
                log.exception("a close hook of the engine raised")
        if self._imm is not None:
            self._imm.fail_all(EngineClosed("engine closed"))
        still_posted = [r for r in self._regions if r.posted]
        if still_posted and not all(d.closes_with_ops_posted for d in self._domains):
            # A stalled peer still has reads or writes of ours posted, and this provider can crash
            # closing such an endpoint: leave the endpoints and those regions (memory included) open
            # for the life of the process. Nothing progresses them any more, so nothing lands.
            log.warning(
                "%s engine closed with %d chunk(s) still posted to a stalled peer: its endpoints and %d "
                "region(s) (%d bytes) stay open (docs/transport.md, closing with ops posted)",
                self.provider, sum(r.posted for r in still_posted), len(still_posted),
                sum(r.nbytes for r in still_posted),
            )
            _left_open.append((self._domains, still_posted, self._progress))
            for region in [r for r in self._regions if not r.posted]:
                region.closed = False
                self.deregister(region)
            self._domains = []
            return
        for region in list(self._regions):  # progress threads are gone: nothing is posted any more
            region.posted = 0
            region.closed = False
            self.deregister(region)
        if self._progress is not None:
            self._progress.close_domains()
        else:
            for dom in self._domains:
                dom.close()
        self._domains = []

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- internals ----------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise EngineClosed(f"{what}: engine is closed")

    def _route(self, address: bytes) -> Route:
        self._check_open("connect")
        route = self._routes.get(address)
        if route is not None:
            return route
        ea = EngineAddress.from_bytes(address)
        if ea.provider != self.provider:
            raise TransferError(f"peer uses provider {ea.provider!r}, this engine {self.provider!r}")
        n = len(ea.domains)
        handles = [dom.insert_peer(ea.domains[i % n]) for i, dom in enumerate(self._domains)]
        route = Route(f"{self.provider}:{self._domains[0].straddr(ea.domains[0])}", handles, n)
        with self._lock:
            return self._routes.setdefault(address, route)

# Endpoints (and the regions with ops still posted on them) an engine could not safely close.
_left_open: list[tuple[list[Domain], list[Region], Progress | None]] = []


def _buffer_of(obj: Any) -> tuple[int, int, Any]:
    """(ptr, nbytes, object to keep alive) for a tensor, a buffer or a (ptr, nbytes) pair."""
    if isinstance(obj, tuple):
        ptr, nbytes = obj
        return int(ptr), int(nbytes), None
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):
        if obj.device.type != "cpu":
            raise TransferError(f"register: {obj.device.type} tensors are not supported (host memory only)")
        if not obj.is_contiguous():
            raise TransferError("register: tensor is not contiguous")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), obj
    try:
        return buffer_address(obj)
    except TypeError as exc:
        raise TransferError(f"register: {type(obj).__name__} is not a tensor, buffer or (ptr, nbytes)") from (
            exc
        )
