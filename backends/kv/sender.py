"""The prefill side of KV transfer: accept receivers, write requests' pages into their pools.

Flow: a receiver joins (hello: its geometry and immediate range; answered with welcome or reject)
and asks for a request (want: request id, its page ids, a slot, and a grant: write-only regions of
exactly those pages, revoked by the receiver when the request settles). `KvSender.start` pairs it
with the sender's page ids (either may come first). Each layer's K and V pages go out as one op of
batched writes whose immediate announces the layer; after every layer landed, one more immediate
completes the request. A dead receiver fails only its own requests, within the engine's timeout_s.

Thread-safety: any thread may call; message callbacks run on the engine's progress thread.
"""

from __future__ import annotations

import bisect
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import backends.kv.messages as wire
from backends.channel import ImmRange, Message
from backends.descriptor import EngineAddress, MemoryRegionDescriptor
from backends.errors import PeerUnreachable, TransferError, TransferTimeout
from backends.kv.futures import fail, log_failure, settle
from backends.kv.pool import KvError, KvGeometry, KvPool
from backends.progress import Part
from backends.spans import page_spans

log = logging.getLogger(__name__)


@dataclass
class _Receiver:
    address: bytes
    geometry: KvGeometry
    imms: ImmRange
    label: str
    domains: int  # keys per grant entry: one per domain of the receiver's engine
    requests: set[str] = field(default_factory=set)
    held: int = 0  # partial page lists and unpaired wants this receiver has here (capped at slots)

    @property
    def slots(self) -> int:
        """Request slots the receiver's immediate range holds."""
        return self.imms.count // (self.geometry.layers + 1)

    def imm(self, slot: int, layer: int) -> int:
        """The immediate announcing `layer` of the request in `slot` (layer == layers: complete)."""
        return self.imms.value(wire.imm_index(slot, layer, self.geometry.layers))

    def grant(self, count: int, regions: list[list[int]]) -> list[MemoryRegionDescriptor]:
        """A grant item's regions as descriptors (per layer, per half) of the receiver's memory."""
        length = count * self.geometry.page_bytes
        return [MemoryRegionDescriptor(self.address, tuple(e[1:]), e[0], length, "write") for e in regions]


@dataclass
class _Want:
    receiver: bytes
    slot: int
    pages: list[int]
    ranges: list[tuple[int, int]]  # granted (start, count), sorted, not overlapping, covering pages
    grant: list[list[MemoryRegionDescriptor]]  # per range, per (layer, half): where its pages may go
    since: float = field(default_factory=time.monotonic)


@dataclass
class _Partial:
    """A want's page runs while its parts arrive."""

    parts: int
    slot: int
    got: dict[int, tuple[list[list[int]], list[wire.GrantItem]]] = field(default_factory=dict)
    pages: int = 0
    ranges: int = 0
    since: float = field(default_factory=time.monotonic)


MAX_RID = 256  # characters of a request id
ENDED_KEPT = 4096  # ids of requests that ended unsent, remembered to refuse late wants at once


class OutgoingRequest:
    """The sender's side of one request: mark layers ready as prefill computes them.

    `done` resolves once every layer and the completing immediate were delivered, or fails with
    an error naming the request and the receiver.
    """

    def __init__(
        self, sender: KvSender, request_id: str, src_pages: list[int], *, suffix_ok: bool = False
    ) -> None:
        self.sender = sender
        self.request_id = request_id
        self.src_pages = src_pages
        self.suffix_ok = suffix_ok
        self.done: Future[None] = Future()
        self.done.set_running_or_notify_cancel()
        self._ready: set[int] = set()
        self._posted: set[int] = set()
        self._landed = 0
        self._want: _Want | None = None
        # per granted range of the want: (source pages, destination pages relative to the range's start)
        self._by_range: dict[int, tuple[list[int], list[int]]] = {}

    def send_layer(self, layer: int) -> None:
        """Layer `layer` of the sender's pool holds this request's K and V: send it when possible."""
        layers = self.sender.pool.geometry.layers
        if not 0 <= layer < layers:
            raise ValueError(f"request {self.request_id}: layer {layer} is outside 0..{layers - 1}")
        self.sender._layer_ready(self, layer)

    def send_all(self) -> OutgoingRequest:
        """Every layer is ready (prefill finished): send them all."""
        for layer in range(self.sender.pool.geometry.layers):
            self.sender._layer_ready(self, layer)
        return self

    def abort(self, reason: str) -> None:
        """Give up on this request (e.g. its decode side never asked): `done` fails with reason, and a
        receiver that already asked is told, so neither side holds the request's pages for it."""
        err = KvError(f"KV request {self.request_id}: {reason}")
        want = self._want
        fail(self.done, err)
        if want is not None:
            self.sender._reply(want.receiver, wire.FAILED, rid=self.request_id, reason=str(err))

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until delivered; raises the request's error, or TransferTimeout.

        timeout_s defaults to the engine's; it also bounds waiting for a receiver that never asked.
        """
        timeout = self.sender.engine.timeout_s if timeout_s is None else timeout_s
        try:
            self.done.result(timeout)
        except TimeoutError as exc:
            state = "no receiver asked for it" if self._want is None else "not delivered"
            raise TransferTimeout(f"KV request {self.request_id}: {state} within {timeout:g}s") from exc


class KvSender:
    """Prefill side: accepts receivers and writes requests' pages into their pools (channel "kv").

    What a receiver can make the sender hold is bounded: its partial page lists and the wants no
    prefill has started yet count against its slots; partial lists expire after the engine's
    timeout_s, unpaired wants after want_ttl_s (the receiver is told, its request fails).
    channel_key: an optional secret shared with the receivers at set-up (backends.channel).
    """

    def __init__(self, pool: KvPool, *, want_ttl_s: float = 300.0, channel_key: bytes | None = None) -> None:
        self.pool = pool
        self.engine = pool.engine
        self.want_ttl_s = float(want_ttl_s)
        self._lock = threading.Lock()
        self._receivers: dict[bytes, _Receiver] = {}
        self._wants: dict[str, _Want] = {}
        self._parts: dict[tuple[bytes, str], _Partial] = {}
        self._outgoing: dict[str, OutgoingRequest] = {}
        # ids of requests that ended unsent (aborted, failed), so a late want is refused at once
        self._ended: OrderedDict[str, str] = OrderedDict()
        self.channel = self.engine.channel(wire.CHANNEL, key=channel_key)
        self.channel.on_message(self._on_message)

    @property
    def address(self) -> bytes:
        """What receivers join (the engine's address)."""
        return self.engine.address

    def receivers(self) -> list[str]:
        """Labels of the receivers joined now."""
        with self._lock:
            return [r.label for r in self._receivers.values()]

    def start(self, request_id: str, src_pages: Sequence[int], *, suffix_ok: bool = False) -> OutgoingRequest:
        """Begin a request whose K/V lives in src_pages of every layer; then send_layer/send_all.

        suffix_ok: a receiver may ask for fewer pages (it already holds the prompt's first pages, e.g.
        from its prefix cache): it gets the last ones. Otherwise the counts must be equal.
        """
        pages = self.pool.geometry.check_pages(src_pages, f"KV request {request_id}")
        req = OutgoingRequest(self, request_id, pages, suffix_ok=suffix_ok)
        with self._lock:
            if request_id in self._outgoing:
                raise KvError(f"KV request {request_id} is already being sent")
            self._outgoing[request_id] = req
            want = self._wants.pop(request_id, None)
            if want is not None:
                rec = self._receivers.get(want.receiver)
                if rec is not None:
                    rec.held -= 1
        req.done.add_done_callback(lambda _f: self._forget(request_id))
        if want is not None:
            self._pair(req, want)
        return req

    def close(self) -> None:
        """Stop taking receivers and requests (the channel closes; the pool and engine stay)."""
        self.channel.close()

    # -- internals (message callbacks run on the engine's progress thread: keep them short) --
    def _on_message(self, message: Message) -> None:
        try:
            msg = message.fields()
            if message.kind == wire.HELLO:
                self._hello(message.sender, msg)
            elif message.kind == wire.BYE:
                self._bye(message.sender)
            elif message.kind == wire.WANT:
                self._want_part(message.sender, msg)
            elif message.kind == wire.CANCEL:
                self._cancel(message.sender, msg)
            else:
                log.warning("KV sender: unknown message kind %r", message.kind)
        except (KeyError, TypeError, ValueError, TransferError) as exc:
            log.warning("KV sender: bad %s message: %s", message.kind, exc)

    def _reply(self, address: bytes, kind: str, **fields: Any) -> None:
        try:
            fut = self.channel.send_json(address, kind, **fields)
        except TransferError as exc:
            log.warning("KV sender: could not answer %s (%s)", kind, exc)
            return
        fut.add_done_callback(log_failure(f"KV sender: {kind} reply"))

    def _hello(self, address: bytes, msg: dict[str, Any]) -> None:
        try:
            geo = KvGeometry.from_dict(msg["geometry"])
            imms = ImmRange.from_json(msg["imms"])
            mine = self.pool.geometry
            if (geo.layers, geo.page_bytes, geo.halves) != (mine.layers, mine.page_bytes, mine.halves):
                raise KvError(  # noqa: TRY301 - answered to the peer below
                    f"geometry {geo.layers} layers x {geo.page_bytes} B pages ({geo.halves} halves) does not "
                    f"match the sender's {mine.layers} x {mine.page_bytes} B ({mine.halves} halves)"
                )
            if imms.count < geo.layers + 1:
                raise KvError(f"immediate range of {imms.count} values holds no request slot")  # noqa: TRY301
            domains = len(EngineAddress.from_bytes(address).domains)
        except (KvError, ValueError, KeyError, TypeError, TransferError) as exc:
            log.warning("KV sender: rejected a receiver: %s", exc)
            self._reply(address, wire.REJECT, reason=str(exc))
            return
        label = str(msg.get("name") or address[-8:].hex())[:64]
        with self._lock:
            old = self._receivers.get(address)
            rec = _Receiver(address, geo, imms, label, domains)
            if old is not None:
                rec.requests, rec.held = old.requests, old.held
            self._receivers[address] = rec
        log.info("KV sender: receiver %s joined (%d pages of %d B)", label, geo.pages, geo.page_bytes)
        self._reply(address, wire.WELCOME, layers=self.pool.geometry.layers)

    def _bye(self, address: bytes) -> None:
        with self._lock:
            rec = self._receivers.pop(address, None)
            if rec is None:
                return
            failed = [self._outgoing[r] for r in rec.requests if r in self._outgoing]
            for rid in [r for r, w in self._wants.items() if w.receiver == address]:
                del self._wants[rid]
            for key in [k for k in self._parts if k[0] == address]:
                del self._parts[key]
        log.info("KV sender: receiver %s left", rec.label)
        for req in failed:
            fail(req.done, KvError(f"KV request {req.request_id}: receiver {rec.label} left"))

    def _want_part(self, address: bytes, msg: dict[str, Any]) -> None:
        rid, part, parts, slot = msg["rid"], msg["part"], msg["parts"], msg["slot"]
        if not isinstance(rid, str) or not 0 < len(rid) <= MAX_RID:
            raise ValueError(f"a request id is a string of 1..{MAX_RID} characters")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (part, parts, slot)):
            raise ValueError(f"KV request {rid}: part, parts and slot must be integers")  # noqa: TRY004
        with self._lock:
            rec = self._receivers.get(address)
        if rec is None:
            if part == 0:  # answered once per want, whatever order its parts come in
                self._orphan(address, rid, "receiver left or never joined this sender")
            return
        geo = rec.geometry
        try:
            if not 0 <= slot < rec.slots:
                raise KvError(f"KV request {rid}: slot {slot} out of range")  # noqa: TRY301
            if not 0 <= part < parts <= geo.pages:
                raise KvError(f"KV request {rid}: part {part} of {parts} is out of range")  # noqa: TRY301
            runs = wire.checked_runs(msg["pages"], geo.pages, geo.pages)
            grant = wire.checked_grant(msg.get("grant"), geo.pages, geo.layers * geo.halves, rec.domains)
        except (KvError, ValueError) as exc:
            self._reply(address, wire.FAILED, rid=rid, reason=str(exc))
            return
        self._expire()
        reason = None
        with self._lock:
            key = (address, rid)
            partial = self._parts.get(key)
            if partial is None:
                if rec.held >= rec.slots:
                    reason = f"receiver {rec.label} already has {rec.slots} requests held here"
                else:
                    partial = self._parts[key] = _Partial(parts, slot)
                    rec.held += 1
            if partial is not None:
                if partial.parts != parts or partial.slot != slot or part in partial.got:
                    reason = f"KV request {rid}: part {part} of {parts} does not fit the parts before it"
                elif max(partial.pages + sum(n for _, n in runs), partial.ranges + len(grant)) > geo.pages:
                    reason = f"KV request {rid}: more than {geo.pages} pages"
                if reason is not None:
                    del self._parts[key]
                    rec.held -= 1
                else:
                    partial.got[part] = (runs, grant)
                    partial.pages += sum(n for _, n in runs)
                    partial.ranges += len(grant)
                    if len(partial.got) < parts:
                        return
                    del self._parts[key]
                    rec.held -= 1
        if reason is not None:
            self._reply(address, wire.FAILED, rid=rid, reason=reason)
            return
        assert partial is not None
        page_runs = [r for i in range(parts) for r in partial.got[i][0]]
        items = [g for i in range(parts) for g in partial.got[i][1]]
        pages = wire.unruns(page_runs)  # checked: at most geo.pages of them
        ranges = [(start, count) for start, count, _ in items]
        uncovered = _uncovered(pages, ranges)
        if uncovered is not None:
            self._reply(address, wire.FAILED, rid=rid, reason=f"KV request {rid}: {uncovered}")
            return
        want = _Want(address, slot, pages, ranges, [rec.grant(count, regions) for _, count, regions in items])
        with self._lock:
            ended = self._ended.pop(rid, None)
        if ended is not None:
            self._reply(address, wire.FAILED, rid=rid, reason=ended)
            return
        with self._lock:
            req = self._outgoing.get(rid)
            duplicate = rid in self._wants or (req is not None and req._want is not None)
            if req is None and not duplicate and rec.held < rec.slots:
                self._wants[rid] = want
                rec.held += 1
                return
        if duplicate:
            self._reply(address, wire.FAILED, rid=rid, reason=f"KV request {rid} was already asked for")
            return
        if req is None:
            self._reply(address, wire.FAILED, rid=rid, reason=f"receiver {rec.label} holds too many wants")
            return
        self._pair(req, want)

    def _orphan(self, address: bytes, rid: str, reason: str) -> None:
        """A want from an address that is not a joined receiver (a want may overtake its bye)."""
        self._reply(address, wire.FAILED, rid=rid, reason=reason)
        with self._lock:
            orphan = self._outgoing.get(rid)
        if orphan is not None and orphan._want is None:
            fail(orphan.done, KvError(f"KV request {rid}: {reason}"))

    def _expire(self) -> None:
        """Drop partial page lists older than the engine's timeout_s and wants older than want_ttl_s."""
        now = time.monotonic()
        with self._lock:
            stale_parts = [k for k, p in self._parts.items() if now - p.since > self.engine.timeout_s]
            for key in stale_parts:
                del self._parts[key]
            stale_wants = [(rid, w) for rid, w in self._wants.items() if now - w.since > self.want_ttl_s]
            for rid, _ in stale_wants:
                del self._wants[rid]
            for address in [k[0] for k in stale_parts] + [w.receiver for _, w in stale_wants]:
                rec = self._receivers.get(address)
                if rec is not None:
                    rec.held -= 1
        for address, rid in stale_parts:
            reason = f"KV request {rid}: its parts did not all arrive"
            self._reply(address, wire.FAILED, rid=rid, reason=reason)
        for rid, w in stale_wants:
            self._reply(w.receiver, wire.FAILED, rid=rid, reason=f"KV request {rid}: not started here within "
                        f"{self.want_ttl_s:g}s")

    def _cancel(self, address: bytes, msg: dict[str, Any]) -> None:
        """The receiver gave up on a request: stop writing it (only the receiver that asked may)."""
        rid = msg["rid"]
        if not isinstance(rid, str):
            raise ValueError("a request id is a string")  # noqa: TRY004
        with self._lock:
            want = self._wants.get(rid)
            if want is not None and want.receiver == address:
                del self._wants[rid]
                rec = self._receivers.get(address)
                if rec is not None:
                    rec.held -= 1
            req = self._outgoing.get(rid)
        if req is not None and req._want is not None and req._want.receiver == address:
            fail(req.done, KvError(f"KV request {rid}: the receiver cancelled it"))

    def _pair(self, req: OutgoingRequest, want: _Want) -> None:
        with self._lock:
            rec = self._receivers.get(want.receiver)
            if rec is not None:
                rec.requests.add(req.request_id)
        if rec is None:
            fail(req.done, KvError(f"KV request {req.request_id}: its receiver left before the transfer"))
            return
        if req.suffix_ok and 0 < len(want.pages) < len(req.src_pages):
            req.src_pages = req.src_pages[len(req.src_pages) - len(want.pages):]
        if len(want.pages) != len(req.src_pages):
            err = KvError(
                f"KV request {req.request_id}: receiver {rec.label} asked for {len(want.pages)} pages, "
                f"the sender has {len(req.src_pages)}"
            )
            self._reply(want.receiver, wire.FAILED, rid=req.request_id, reason=str(err))
            fail(req.done, err)
            return
        req._by_range = _by_range(req.src_pages, want)
        with self._lock:
            req._want = want
        self._post_ready(req)

    def _layer_ready(self, req: OutgoingRequest, layer: int) -> None:
        with self._lock:
            req._ready.add(layer)
        self._post_ready(req)

    def _post_ready(self, req: OutgoingRequest) -> None:
        with self._lock:
            want = req._want
            if want is None or req.done.done():
                return
            todo = sorted(req._ready - req._posted)
            req._posted.update(todo)
            rec = self._receivers.get(want.receiver)
        if rec is None:
            fail(req.done, KvError(f"KV request {req.request_id}: receiver left"))
            return
        for layer in todo:
            try:
                imm = rec.imm(want.slot, layer)
                fut = self.engine.start_op("kv layer", self._layer_parts(req, want, layer, imm)).future
            except TransferError as exc:
                fail(req.done, KvError(f"KV request {req.request_id} layer {layer} to {rec.label}: {exc}"))
                return
            fut.add_done_callback(functools.partial(self._layer_done, req, rec, layer))

    def _layer_parts(self, req: OutgoingRequest, want: _Want, layer: int, imm: int) -> list[Part]:
        """One layer's writes: per granted range and half, its pages into that range's region; then the
        layer's immediate."""
        geo = self.pool.geometry
        region, src_base = self.pool.layer_region(layer)
        page, halves = geo.page_bytes, geo.halves
        parts: list[Part] = []
        for r, (src, dst) in req._by_range.items():
            for kv in range(halves):
                spans = page_spans(src, src_base + kv * geo.pages * page, page, dst, 0, page, page)
                parts.append(self.engine.write_part(region, spans, want.grant[r][layer * halves + kv]))
        parts.append(self.engine.imm_part(imm, want.grant[0][layer * halves]))
        return parts

    def _layer_done(self, req: OutgoingRequest, rec: _Receiver, layer: int, fut: Future[None]) -> None:
        exc = fut.exception()
        if exc is not None:
            err_type = PeerUnreachable if isinstance(exc, PeerUnreachable) else KvError
            what = f"KV request {req.request_id} layer {layer} to receiver {rec.label}"
            fail(req.done, err_type(f"{what}: {exc}"))
            return
        with self._lock:
            req._landed += 1
            complete = req._landed == self.pool.geometry.layers
        if not complete or req._want is None:
            return
        try:
            last = self.engine.write_imm(rec.imm(req._want.slot, rec.geometry.layers), req._want.grant[0][0])
        except TransferError as exc:
            fail(req.done, KvError(f"KV request {req.request_id} completion to {rec.label}: {exc}"))
            return
        last.add_done_callback(lambda f: settle(req.done, f, f"KV request {req.request_id} to {rec.label}"))

    def _forget(self, request_id: str) -> None:
        with self._lock:
            req = self._outgoing.pop(request_id, None)
            if req is not None and req._want is None and req.done.exception() is not None:
                self._ended[request_id] = str(req.done.exception())
                while len(self._ended) > ENDED_KEPT:
                    self._ended.popitem(last=False)
            if req is not None and req._want is not None:
                rec = self._receivers.get(req._want.receiver)
                if rec is not None:
                    rec.requests.discard(request_id)


def _uncovered(pages: list[int], ranges: list[tuple[int, int]]) -> str | None:
    """Why a want's grant does not fit its pages (ranges out of order or overlapping, a page in none of
    them), or None when every page lies in exactly one range."""
    if not ranges:
        return "no page is granted"
    for (s0, n0), (s1, _) in zip(ranges, ranges[1:], strict=False):
        if s1 < s0 + n0:
            return f"granted ranges at pages {s0} and {s1} are out of order or overlap"
    starts = [s for s, _ in ranges]
    for p in pages:
        i = bisect.bisect_right(starts, p) - 1
        if i < 0 or p >= starts[i] + ranges[i][1]:
            return f"page {p} is not granted"
    return None


def _by_range(src_pages: list[int], want: _Want) -> dict[int, tuple[list[int], list[int]]]:
    """Pair each source page with its destination's granted range (checked by _uncovered)."""
    starts = [s for s, _ in want.ranges]
    out: dict[int, tuple[list[int], list[int]]] = {}
    for src, dst in zip(src_pages, want.pages, strict=True):
        r = bisect.bisect_right(starts, dst) - 1
        group = out.setdefault(r, ([], []))
        group[0].append(src)
        group[1].append(dst - starts[r])
    return out
