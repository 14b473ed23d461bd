"""Paged KV-cache transfer for disaggregated prefill/decode, shaped like SGLang/vLLM paged pools.

A pool is one registered buffer of `layers x (K, V) x pages x page_bytes`: page p of layer l, half
kv (0 = K, 1 = V) starts at byte ((l * 2 + kv) * pages + p) * page_bytes. It is registered once.

Flow (the decode side pulls nothing; the prefill side writes):
1. A `KvReceiver` (decode) joins a `KvSender` (prefill) with a *hello* carrying its pool descriptor
   and geometry over the engine's two-sided messages; the sender answers *welcome* or *reject*.
   Receivers join and leave at run time (elastic, no barrier, no separate server).
2. Per request the receiver picks its own page ids and sends a *want* (request id, page ids, imm
   slot). `KvSender.start(request_id, src_pages)` pairs it with the sender's page ids (either may
   come first).
3. The sender writes each layer's K and V pages (adjacent pages merged) as one batched op; when a
   layer has landed it sends that layer's immediate, so decode can start on layer 0 while later
   layers are in flight. After every layer, one more immediate completes the request. The
   receiver's ImmCounter counts them: no ordering between writes is assumed.
4. A dead receiver fails only its own requests, within the engine's timeout_s; the sender stays up.

Immediates: bit 31 set marks KV traffic; bits 12..30 are the receiver-chosen request slot; bits
0..11 the layer, 0xFFF meaning "request complete". So layers <= 4095 and a receiver has up to 2^19
requests in flight; other users of the same engine should keep bit 31 clear.

Thread-safety: both classes may be used from any thread; they own the engine's on_message callback
(route other messages through `KvSender.on_other_message` / `KvReceiver.on_other_message`).
"""

from __future__ import annotations

import base64
import functools
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from backends.descriptor import MemoryRegionDescriptor
from backends.engine import Region, TransferEngine
from backends.errors import PeerUnreachable, TransferError, TransferTimeout

log = logging.getLogger(__name__)

_MAGIC = b"RFKV1"
KV_IMM_TAG = 1 << 31
_DONE_LAYER = 0xFFF
MAX_LAYERS = _DONE_LAYER
_SLOTS = 1 << 19
# shm 1.17 stalls on sends above ~4 KiB (docs/transport.md): page lists travel in parts below that.
_PART_BYTES = 3000


class KvError(TransferError):
    """A KV request or handshake failed; the message names the request and the peer."""


@dataclass(frozen=True, slots=True)
class KvGeometry:
    """Shape of a paged pool in bytes: layers x (K, V) x pages x page_bytes."""

    layers: int
    pages: int
    page_bytes: int

    def __post_init__(self) -> None:
        if not 0 < self.layers <= MAX_LAYERS:
            raise ValueError(f"layers must be in 1..{MAX_LAYERS}, not {self.layers}")
        if self.pages <= 0 or self.page_bytes <= 0:
            raise ValueError(f"pages and page_bytes must be positive, not {self.pages}, {self.page_bytes}")

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return self.layers * 2 * self.pages * self.page_bytes

    def offset(self, layer: int, kv: int, page: int) -> int:
        """Byte offset of page `page` of layer `layer`, half kv (0 = K, 1 = V)."""
        return ((layer * 2 + kv) * self.pages + page) * self.page_bytes

    def check_pages(self, pages: Sequence[int], what: str) -> list[int]:
        """The pages as ints; KvError naming `what` when one is out of range."""
        out = [int(p) for p in pages]
        bad = [p for p in out if not 0 <= p < self.pages]
        if bad:
            raise KvError(f"{what}: page id {bad[0]} is outside 0..{self.pages - 1}")
        return out

    def to_dict(self) -> dict[str, int]:
        """JSON form for the handshake."""
        return {"layers": self.layers, "pages": self.pages, "page_bytes": self.page_bytes}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KvGeometry:
        """Inverse of to_dict; ValueError on missing or bad fields."""
        return cls(int(d["layers"]), int(d["pages"]), int(d["page_bytes"]))


class KvPool:
    """A paged KV pool registered once with an engine.

    buffer: a contiguous CPU tensor or writable buffer of exactly geometry.nbytes (e.g. the
    model's cache viewed as bytes); by default a zeroed numpy array is allocated.
    """

    def __init__(
        self,
        engine: TransferEngine,
        *,
        layers: int,
        pages: int,
        page_bytes: int,
        buffer: Any = None,
        access: str = "rw",
    ) -> None:
        self.engine = engine
        self.geometry = KvGeometry(layers, pages, page_bytes)
        if buffer is None:
            import numpy as np

            buffer = np.zeros(self.geometry.nbytes, dtype=np.uint8)
        self.buffer = buffer
        self.region: Region = engine.register(buffer, access)
        if self.region.nbytes != self.geometry.nbytes:
            nbytes = self.region.nbytes
            self.region.close()
            raise ValueError(f"pool buffer has {nbytes} bytes, geometry needs {self.geometry.nbytes}")

    @property
    def descriptor(self) -> MemoryRegionDescriptor:
        """What peers need to write into this pool."""
        return self.region.descriptor

    def close(self) -> None:
        """Deregister the pool (no transfer may still be running on it)."""
        self.region.close()


def layer_spans(
    src: KvGeometry, src_pages: Sequence[int], dst: KvGeometry, dst_pages: Sequence[int], layer: int
) -> list[tuple[int, int, int]]:
    """(src_offset, dst_offset, length) for layer's K and V pages, merging pages adjacent on both sides."""
    page = src.page_bytes
    spans: list[tuple[int, int, int]] = []
    for kv in (0, 1):
        s_base, d_base = src.offset(layer, kv, 0), dst.offset(layer, kv, 0)
        start_s = start_d = end_s = end_d = -1
        for sp, dp in zip(src_pages, dst_pages, strict=True):
            so, do = s_base + sp * page, d_base + dp * page
            if so == end_s and do == end_d:
                end_s += page
                end_d += page
                continue
            if end_s >= 0:
                spans.append((start_s, start_d, end_s - start_s))
            start_s, start_d, end_s, end_d = so, do, so + page, do + page
        if end_s >= 0:
            spans.append((start_s, start_d, end_s - start_s))
    return spans


def imm_for(slot: int, layer: int) -> int:
    """The immediate announcing `layer` of the request in `slot` (layer 0xFFF: request complete)."""
    return KV_IMM_TAG | (slot << 12) | layer


# ----- messages -----------------------------------------------------------------------------------
def _encode(kind: str, **fields: Any) -> bytes:
    return _MAGIC + json.dumps({"t": kind, **fields}, separators=(",", ":")).encode()


def _decode(data: bytes) -> dict[str, Any] | None:
    if not data.startswith(_MAGIC):
        return None
    msg = json.loads(data[len(_MAGIC) :])
    if not isinstance(msg, dict) or "t" not in msg:
        raise ValueError("not a KV message object")
    return msg


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s.encode(), validate=True)


def _runs(pages: Sequence[int]) -> list[list[int]]:
    """[[start, count], ...]: page lists are mostly runs, and messages must stay small."""
    out: list[list[int]] = []
    for p in pages:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1][1] += 1
        else:
            out.append([p, 1])
    return out


def _unruns(runs: Sequence[Sequence[int]]) -> list[int]:
    return [s + i for s, n in runs for i in range(int(n))]


def _parts(runs: list[list[int]]) -> list[list[list[int]]]:
    """Split runs into message-sized parts (JSON of each below _PART_BYTES)."""
    parts: list[list[list[int]]] = [[]]
    size = 0
    for r in runs:
        n = len(str(r[0])) + len(str(r[1])) + 4
        if parts[-1] and size + n > _PART_BYTES:
            parts.append([])
            size = 0
        parts[-1].append(r)
        size += n
    return parts


# ----- sender (prefill side) ----------------------------------------------------------------------
@dataclass
class _Receiver:
    address: bytes
    desc: MemoryRegionDescriptor
    geometry: KvGeometry
    label: str
    requests: set[str] = field(default_factory=set)


@dataclass
class _Want:
    receiver: bytes
    slot: int
    pages: list[int]


class OutgoingRequest:
    """The sender's side of one request: mark layers ready as prefill computes them.

    `done` resolves once every layer and the completing immediate were delivered, or fails with
    an error naming the request and the receiver.
    """

    def __init__(self, sender: KvSender, request_id: str, src_pages: list[int]) -> None:
        self.sender = sender
        self.request_id = request_id
        self.src_pages = src_pages
        self.done: Future[None] = Future()
        self.done.set_running_or_notify_cancel()
        self._ready: set[int] = set()
        self._posted: set[int] = set()
        self._landed = 0
        self._want: _Want | None = None

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
    """Prefill side: accepts receivers and writes requests' pages into their pools."""

    def __init__(self, pool: KvPool) -> None:
        self.pool = pool
        self.engine = pool.engine
        self._lock = threading.Lock()
        self._receivers: dict[bytes, _Receiver] = {}
        self._wants: dict[str, _Want] = {}
        self._parts: dict[str, dict[int, list[list[int]]]] = {}
        self._outgoing: dict[str, OutgoingRequest] = {}
        self.on_other_message: Callable[[bytes], None] | None = None
        self.engine.on_message(self._on_message)

    @property
    def address(self) -> bytes:
        """What receivers join (the engine's address)."""
        return self.engine.address

    def receivers(self) -> list[str]:
        """Labels of the receivers joined now."""
        with self._lock:
            return [r.label for r in self._receivers.values()]

    def start(self, request_id: str, src_pages: Sequence[int]) -> OutgoingRequest:
        """Begin a request whose K/V lives in src_pages of every layer; then send_layer/send_all."""
        pages = self.pool.geometry.check_pages(src_pages, f"KV request {request_id}")
        req = OutgoingRequest(self, request_id, pages)
        with self._lock:
            if request_id in self._outgoing:
                raise KvError(f"KV request {request_id} is already being sent")
            self._outgoing[request_id] = req
            want = self._wants.pop(request_id, None)
        req.done.add_done_callback(lambda _f: self._forget(request_id))
        if want is not None:
            self._pair(req, want)
        return req

    # -- internals (message callbacks run on the engine's progress thread: keep them short) --
    def _on_message(self, data: bytes) -> None:
        try:
            msg = _decode(data)
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning("KV sender: dropped a malformed message (%s)", exc)
            return
        if msg is None:
            if self.on_other_message is not None:
                self.on_other_message(data)
            return
        try:
            kind = msg["t"]
            if kind == "hello":
                self._hello(msg)
            elif kind == "bye":
                self._bye(_unb64(msg["addr"]))
            elif kind == "want":
                self._want_part(msg)
            else:
                log.warning("KV sender: unknown message type %r", kind)
        except (KeyError, TypeError, ValueError, TransferError) as exc:
            log.warning("KV sender: bad %s message: %s", msg.get("t"), exc)

    def _reply(self, address: bytes, kind: str, **fields: Any) -> None:
        try:
            fut = self.engine.send(address, _encode(kind, **fields))
        except TransferError as exc:
            log.warning("KV sender: could not answer %s (%s)", kind, exc)
            return
        fut.add_done_callback(_log_failure(f"KV sender: {kind} reply"))

    def _hello(self, msg: dict[str, Any]) -> None:
        address = _unb64(msg["addr"])
        try:
            desc = MemoryRegionDescriptor.from_bytes(_unb64(msg["desc"]))
            geo = KvGeometry.from_dict(msg["geometry"])
            mine = self.pool.geometry
            if geo.layers != mine.layers or geo.page_bytes != mine.page_bytes:
                raise KvError(  # noqa: TRY301 - answered to the peer below
                    f"geometry {geo.layers} layers x {geo.page_bytes} B pages does not match the sender's "
                    f"{mine.layers} x {mine.page_bytes} B"
                )
            if not desc.writable or desc.length < geo.nbytes:
                raise KvError("pool descriptor is not writable or smaller than its geometry")  # noqa: TRY301
        except (KvError, ValueError, KeyError, TypeError, TransferError) as exc:
            log.warning("KV sender: rejected a receiver: %s", exc)
            self._reply(address, "reject", reason=str(exc), addr=_b64(self.engine.address))
            return
        label = str(msg.get("name") or desc.address[-8:].hex())
        with self._lock:
            old = self._receivers.get(address)
            self._receivers[address] = _Receiver(address, desc, geo, label, old.requests if old else set())
        log.info("KV sender: receiver %s joined (%d pages of %d B)", label, geo.pages, geo.page_bytes)
        self._reply(address, "welcome", layers=self.pool.geometry.layers, addr=_b64(self.engine.address))

    def _bye(self, address: bytes) -> None:
        with self._lock:
            rec = self._receivers.pop(address, None)
            if rec is None:
                return
            failed = [self._outgoing[r] for r in rec.requests if r in self._outgoing]
            for rid in [r for r, w in self._wants.items() if w.receiver == address]:
                del self._wants[rid]
        log.info("KV sender: receiver %s left", rec.label)
        for req in failed:
            _fail(req.done, KvError(f"KV request {req.request_id}: receiver {rec.label} left"))

    def _want_part(self, msg: dict[str, Any]) -> None:
        rid, part, parts = str(msg["rid"]), int(msg["part"]), int(msg["parts"])
        address = _unb64(msg["addr"])
        with self._lock:
            got = self._parts.setdefault(rid, {})
            got[part] = msg["pages"]
            if len(got) < parts:
                return
            del self._parts[rid]
            rec = self._receivers.get(address)
        runs = [r for i in range(parts) for r in got[i]]
        if rec is None:
            # Messages may be reordered: a want can arrive after its receiver's bye.
            reason = "receiver left or never joined this sender"
            self._reply(address, "failed", rid=rid, reason=reason)
            with self._lock:
                orphan = self._outgoing.get(rid)
            if orphan is not None and orphan._want is None:
                _fail(orphan.done, KvError(f"KV request {rid}: {reason}"))
            return
        try:
            pages = rec.geometry.check_pages(_unruns(runs), f"KV request {rid} (receiver {rec.label})")
            slot = int(msg["slot"])
            if not 0 <= slot < _SLOTS:
                raise KvError(f"KV request {rid}: slot {slot} out of range")  # noqa: TRY301
        except (KvError, ValueError, TypeError) as exc:
            self._reply(address, "failed", rid=rid, reason=str(exc))
            return
        want = _Want(address, slot, pages)
        with self._lock:
            req = self._outgoing.get(rid)
            duplicate = rid in self._wants or (req is not None and req._want is not None)
            if req is None and not duplicate:
                self._wants[rid] = want
                return
        if duplicate:
            self._reply(address, "failed", rid=rid, reason=f"KV request {rid} was already asked for")
            return
        assert req is not None
        self._pair(req, want)

    def _pair(self, req: OutgoingRequest, want: _Want) -> None:
        with self._lock:
            rec = self._receivers.get(want.receiver)
            if rec is not None:
                rec.requests.add(req.request_id)
        if rec is None:
            _fail(req.done, KvError(f"KV request {req.request_id}: its receiver left before the transfer"))
            return
        if len(want.pages) != len(req.src_pages):
            err = KvError(
                f"KV request {req.request_id}: receiver {rec.label} asked for {len(want.pages)} pages, "
                f"the sender has {len(req.src_pages)}"
            )
            self._reply(want.receiver, "failed", rid=req.request_id, reason=str(err))
            _fail(req.done, err)
            return
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
            _fail(req.done, KvError(f"KV request {req.request_id}: receiver left"))
            return
        geo = self.pool.geometry
        for layer in todo:
            spans = layer_spans(geo, req.src_pages, rec.geometry, want.pages, layer)
            try:
                fut = self.engine.write_spans(
                    self.pool.region, spans, rec.desc, imm=imm_for(want.slot, layer)
                )
            except TransferError as exc:
                _fail(req.done, KvError(f"KV request {req.request_id} layer {layer} to {rec.label}: {exc}"))
                return
            fut.add_done_callback(functools.partial(self._layer_done, req, rec, layer))

    def _layer_done(self, req: OutgoingRequest, rec: _Receiver, layer: int, fut: Future[None]) -> None:
        exc = fut.exception()
        if exc is not None:
            err_type = PeerUnreachable if isinstance(exc, PeerUnreachable) else KvError
            _fail(
                req.done,
                err_type(f"KV request {req.request_id} layer {layer} to receiver {rec.label}: {exc}"),
            )
            return
        with self._lock:
            req._landed += 1
            complete = req._landed == self.pool.geometry.layers
        if not complete or req._want is None:
            return
        try:
            last = self.engine.write_imm(imm_for(req._want.slot, _DONE_LAYER), rec.desc)
        except TransferError as exc:
            _fail(req.done, KvError(f"KV request {req.request_id} completion to {rec.label}: {exc}"))
            return
        last.add_done_callback(lambda f: _settle(req.done, f, f"KV request {req.request_id} to {rec.label}"))

    def _forget(self, request_id: str) -> None:
        with self._lock:
            req = self._outgoing.pop(request_id, None)
            if req is not None and req._want is not None:
                rec = self._receivers.get(req._want.receiver)
                if rec is not None:
                    rec.requests.discard(request_id)


# ----- receiver (decode side) ---------------------------------------------------------------------
class IncomingRequest:
    """The receiver's side of one request: wait for layers or for the whole request.

    `done` resolves once every layer's immediate and the completing immediate have arrived, in any
    order: each domain's progress thread counts its own arrivals, so the completing immediate may be
    counted before the last layer's although the sender sent it after that layer was delivered.
    """

    def __init__(
        self, receiver: KvReceiver, request_id: str, sender: bytes, slot: int, pages: list[int]
    ) -> None:
        self.request_id = request_id
        self.pages = pages
        self.slot = slot
        self._receiver = receiver
        self._sender = sender
        eng = receiver.engine
        self.done: Future[None] = Future()
        self.done.set_running_or_notify_cancel()
        self._lock = threading.Lock()
        self._layers = [eng.expect(imm_for(slot, layer)) for layer in range(receiver.pool.geometry.layers)]
        self._complete = eng.expect(imm_for(slot, _DONE_LAYER))
        self._outstanding = len(self._layers) + 1
        self.done.add_done_callback(self._withdraw)
        for fut in (*self._layers, self._complete):
            fut.add_done_callback(self._arrived)

    def _arrived(self, fut: Future[None]) -> None:
        """One of the request's immediates arrived (or the engine closed): done after the last one."""
        exc = fut.exception()
        if exc is not None:
            err = exc if isinstance(exc, TransferError) else TransferError(str(exc))
            _fail(self.done, type(err)(f"KV request {self.request_id}: {err}"))
            return
        with self._lock:
            self._outstanding -= 1
            last = self._outstanding == 0
        if last:
            _settle(self.done, fut, f"KV request {self.request_id}")
        elif fut is self._complete:
            log.debug(
                "KV request %s: completion counted before layer(s) %s",
                self.request_id,
                [i for i, f in enumerate(self._layers) if not f.done()],
            )

    def _withdraw(self, done: Future[None]) -> None:
        """A failed request stops waiting in the ImmCounter (no waiters pile up for dead requests)."""
        if done.exception() is None:
            return
        imm = self._receiver.engine.imm
        for layer, fut in enumerate(self._layers):
            imm.discard(imm_for(self.slot, layer), fut)
        imm.discard(imm_for(self.slot, _DONE_LAYER), self._complete)

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """Block until layer `layer` of this request landed in the pool (or the request failed).

        Returns only once that layer's own immediate arrived. Raises the request's error, or
        TransferTimeout once timeout_s (default: the receiver's) passed without it.
        """
        timeout = self._receiver.timeout_s if timeout_s is None else timeout_s
        fut = self._layers[layer]
        deadline = time.monotonic() + timeout
        while True:
            # done succeeds only after every layer did; then the layer itself is all there is to wait for.
            watch = [fut] if self.done.done() else [fut, self.done]
            wait(watch, max(0.0, deadline - time.monotonic()), return_when=FIRST_COMPLETED)
            if fut.done():
                exc = fut.exception()
                if exc is None:
                    return
                failed = self.done.exception() if self.done.done() else None
                raise failed or exc
            failed = self.done.exception() if self.done.done() else None
            if failed is not None:
                raise failed
            if time.monotonic() >= deadline:
                raise TransferTimeout(
                    f"KV request {self.request_id}: layer {layer} did not arrive from sender "
                    f"{self._receiver._label(self._sender)} within {timeout:g}s"
                )

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every layer landed; raises the request's error or TransferTimeout."""
        timeout = self._receiver.timeout_s if timeout_s is None else timeout_s
        try:
            self.done.result(timeout)
        except TimeoutError as exc:
            raise TransferTimeout(
                f"KV request {self.request_id} did not complete from sender "
                f"{self._receiver._label(self._sender)} within {timeout:g}s"
            ) from exc


class KvReceiver:
    """Decode side: joins senders, asks for requests' pages, waits for them to land in its pool.

    timeout_s bounds joins and the default waits; a dead sender shows up as TransferTimeout.
    """

    def __init__(self, pool: KvPool, *, name: str = "", timeout_s: float | None = None) -> None:
        self.pool = pool
        self.engine = pool.engine
        self.name = name
        self.timeout_s = self.engine.timeout_s if timeout_s is None else float(timeout_s)
        self._lock = threading.Lock()
        self._joins: dict[bytes, Future[None]] = {}
        self._requests: dict[str, IncomingRequest] = {}
        self._slots = itertools.count()
        self.on_other_message: Callable[[bytes], None] | None = None
        self.engine.on_message(self._on_message)

    def join(self, sender: bytes, timeout_s: float | None = None) -> None:
        """Introduce this pool to a sender (hello/welcome); KvError if it rejects, timeout if silent."""
        fut: Future[None] = Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            self._joins[sender] = fut
        hello = _encode(
            "hello",
            addr=_b64(self.engine.address),
            desc=_b64(self.pool.descriptor.to_bytes()),
            geometry=self.pool.geometry.to_dict(),
            name=self.name,
        )
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout  # one bound for sending the hello and for the answer
        try:
            self.engine.send(sender, hello).result(timeout)
            fut.result(max(0.0, deadline - time.monotonic()))
        except TimeoutError as exc:
            with self._lock:
                if self._joins.get(sender) is fut:
                    del self._joins[sender]
            raise TransferTimeout(
                f"KV join: sender {self._label(sender)} did not answer within {timeout:g}s"
            ) from exc

    def leave(self, sender: bytes) -> None:
        """Tell a sender this receiver is gone; its requests there fail on the sender side."""
        try:
            self.engine.send(sender, _encode("bye", addr=_b64(self.engine.address))).result(self.timeout_s)
        except TimeoutError as exc:
            raise TransferTimeout(
                f"KV leave: sender {self._label(sender)} did not take the bye within {self.timeout_s:g}s"
            ) from exc

    def request(self, sender: bytes, request_id: str, dst_pages: Sequence[int]) -> IncomingRequest:
        """Ask `sender` for request_id's K/V into dst_pages of every layer of this pool."""
        pages = self.pool.geometry.check_pages(dst_pages, f"KV request {request_id}")
        with self._lock:
            if request_id in self._requests:
                raise KvError(f"KV request {request_id} is already pending on this receiver")
            slot = next(self._slots) % _SLOTS
            req = IncomingRequest(self, request_id, sender, slot, pages)
            self._requests[request_id] = req
        req.done.add_done_callback(lambda _f: self._forget(request_id))
        parts = _parts(_runs(pages))
        addr = _b64(self.engine.address)
        for i, part in enumerate(parts):
            msg = _encode("want", rid=request_id, slot=slot, part=i, parts=len(parts), pages=part, addr=addr)
            self.engine.send(sender, msg).add_done_callback(
                lambda f: _settle_error(
                    req.done, f, f"KV request {request_id}: want to {self._label(sender)}"
                )
            )
        return req

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._requests.pop(request_id, None)

    def _label(self, address: bytes) -> str:
        return address[-8:].hex()

    def _on_message(self, data: bytes) -> None:
        try:
            msg = _decode(data)
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning("KV receiver: dropped a malformed message (%s)", exc)
            return
        if msg is None:
            if self.on_other_message is not None:
                self.on_other_message(data)
            return
        kind = msg.get("t")
        if kind in ("welcome", "reject"):
            try:
                sender = _unb64(str(msg.get("addr", "")))
            except ValueError:
                log.warning("KV receiver: %s with a malformed sender address", kind)
                return
            with self._lock:
                fut = self._joins.pop(sender, None)
            if fut is None:
                log.warning("KV receiver: %s from a sender it did not join", kind)
            elif kind == "welcome":
                fut.set_result(None)
            else:
                fut.set_exception(
                    KvError(f"KV join: sender {self._label(sender)} refused: {msg.get('reason')}")
                )
        elif kind == "failed":
            with self._lock:
                req = self._requests.get(str(msg.get("rid")))
            if req is not None:
                _fail(req.done, KvError(f"KV request {req.request_id}: sender refused: {msg.get('reason')}"))
        else:
            log.warning("KV receiver: unknown message type %r", kind)


# ----- futures helpers ----------------------------------------------------------------------------
def _fail(fut: Future[None], exc: BaseException) -> None:
    if not fut.done():
        try:
            fut.set_exception(exc)
        except Exception:  # noqa: BLE001 - lost a race with another completion; first one wins
            log.debug("future already settled", exc_info=True)


def _settle(target: Future[None], source: Future[None], what: str) -> None:
    exc = source.exception()
    if exc is None:
        if not target.done():
            try:
                target.set_result(None)
            except Exception:  # noqa: BLE001 - first settlement wins
                log.debug("future already settled", exc_info=True)
    else:
        err = exc if isinstance(exc, TransferError) else TransferError(str(exc))
        _fail(target, type(err)(f"{what}: {err}"))


def _settle_error(target: Future[None], source: Future[None], what: str) -> None:
    exc = source.exception()
    if exc is not None:
        _fail(target, KvError(f"{what}: {exc}"))


def _log_failure(what: str) -> Callable[[Future[None]], None]:
    def cb(f: Future[None]) -> None:
        if f.exception() is not None:
            log.warning("%s failed: %s", what, f.exception())

    return cb
