"""The decode side of KV transfer: join senders, ask for requests' pages, wait for them to land.

Grants: a sender never learns a descriptor of the pool. Each request registers its own write-only
regions, one per (range of its pages adjacent in memory, layer, half), and sends their keys in
its want, which goes only to a sender that welcomed this receiver (with a channel key, the welcome
proves the key). The regions are closed as soon as the request settles (landed, failed, cancelled,
expired): the sender's writes after that are refused by the provider.

The receiver owns its immediates: its channel's range holds `slots` request slots of layers + 1
values each (every layer, then the completion), advertised in hello; a want names the slot. The
engine's ImmCounter counts them from engine open, so none is lost to a late wait, and no ordering
between writes or immediates is assumed.

A slot is never shared: a pending request holds its slot, and a request that failed (refused,
cancelled, or past its request_timeout_s) tells its sender to stop and leaves its slot in
quarantine for quarantine_s, while the sender's writes already posted may still land; the slot's
stale counts are dropped before it is used again, so a late immediate never completes a later
request.

Thread-safety: any thread may call; message callbacks run on the engine's progress thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import backends.kv.messages as wire
from backends.channel import Message
from backends.engine import Region
from backends.errors import TransferError, TransferTimeout
from backends.kv.futures import fail, log_failure, settle, settle_error
from backends.kv.pool import KvError, KvPool

log = logging.getLogger(__name__)

DEFAULT_SLOTS = 1 << 16  # requests a receiver can have in flight (slots are reused round-robin)


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
        self.deadline = time.monotonic() + receiver.request_timeout_s
        self._receiver = receiver
        self._sender = sender
        self.done: Future[None] = Future()
        self.done.set_running_or_notify_cancel()
        self.landed_at: float | None = None  # time.monotonic() when the last immediate was counted
        self.grants: list[Region] = []  # this request's write-only regions; closed once it settles
        self._lock = threading.Lock()
        channel, layers = receiver.channel, receiver.pool.geometry.layers
        self._layers = [channel.expect(wire.imm_index(slot, layer, layers)) for layer in range(layers)]
        self._complete = channel.expect(wire.imm_index(slot, layers, layers))
        self._outstanding = len(self._layers) + 1
        self.done.add_done_callback(self._withdraw)
        for fut in (*self._layers, self._complete):
            fut.add_done_callback(self._arrived)

    def revoke(self) -> None:
        """Close this request's grants (its sender can no longer write its pages); idempotent."""
        with self._lock:
            grants, self.grants = self.grants, []
        for grant in grants:
            grant.close()

    def layer_imm(self, layer: int) -> int:
        """The immediate that announces `layer` of this request (what its sender writes)."""
        layers = self._receiver.pool.geometry.layers
        if not 0 <= layer < layers:
            raise ValueError(f"request {self.request_id}: layer {layer} is outside 0..{layers - 1}")
        return self._receiver.channel.imm(wire.imm_index(self.slot, layer, layers))

    @property
    def done_imm(self) -> int:
        """The immediate that completes this request, sent after every layer landed."""
        layers = self._receiver.pool.geometry.layers
        return self._receiver.channel.imm(wire.imm_index(self.slot, layers, layers))

    def _arrived(self, fut: Future[None]) -> None:
        """One of the request's immediates arrived (or the engine closed): done after the last one."""
        exc = fut.exception()
        if exc is not None:
            err = exc if isinstance(exc, TransferError) else TransferError(str(exc))
            fail(self.done, type(err)(f"KV request {self.request_id}: {err}"))
            return
        with self._lock:
            self._outstanding -= 1
            last = self._outstanding == 0
        if last:
            self.landed_at = time.monotonic()
            settle(self.done, fut, f"KV request {self.request_id}")
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
        channel, layers = self._receiver.channel, self._receiver.pool.geometry.layers
        for layer, fut in enumerate(self._layers):
            channel.discard(wire.imm_index(self.slot, layer, layers), fut)
        channel.discard(wire.imm_index(self.slot, layers, layers), self._complete)

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """Block until layer `layer` of this request landed in the pool (or the request failed).

        Returns only once that layer's own immediate arrived. Raises the request's error, or
        TransferTimeout once timeout_s (default: the receiver's) passed without it.
        """
        timeout = self._receiver.timeout_s if timeout_s is None else timeout_s
        fut = self._layers[layer]
        deadline = min(time.monotonic() + timeout, self.deadline)
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
                if self._expire_if_due():
                    raise self.done.exception()  # type: ignore[misc]
                raise TransferTimeout(
                    f"KV request {self.request_id}: layer {layer} did not arrive from sender "
                    f"{_label(self._sender)} within {timeout:g}s"
                )

    def poll(self) -> bool:
        """True once the request settled (landed or failed); fails it first if its request_timeout_s
        passed, so an engine that only polls (never waits) still sees a silent sender's requests end."""
        self._expire_if_due()
        return self.done.done()

    def cancel(self, reason: str = "cancelled") -> None:
        """Give up on this request: its waiters fail, its sender is told to stop writing it."""
        fail(self.done, KvError(f"KV request {self.request_id}: {reason}"))

    def _expire_if_due(self) -> bool:
        """Fail the request once its request_timeout_s passed; True if it failed so."""
        if not self.done.done() and time.monotonic() >= self.deadline:
            fail(self.done, TransferTimeout(
                f"KV request {self.request_id} did not complete from sender {_label(self._sender)} within "
                f"its request_timeout_s of {self._receiver.request_timeout_s:g}s"
            ))
        return self.done.done() and self.done.exception() is not None

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every layer landed; raises the request's error or TransferTimeout.

        A wait that times out leaves the request pending (wait again), unless the request's own
        request_timeout_s passed: then the request fails and frees its slot."""
        timeout = self._receiver.timeout_s if timeout_s is None else timeout_s
        try:
            self.done.result(max(0.0, min(timeout, self.deadline - time.monotonic())))
        except TimeoutError as exc:
            if self._expire_if_due():
                raise self.done.exception() from exc  # type: ignore[misc]
            raise TransferTimeout(
                f"KV request {self.request_id} did not complete from sender "
                f"{_label(self._sender)} within {timeout:g}s"
            ) from exc


class KvReceiver:
    """Decode side: joins senders, asks for requests' pages, waits for them to land in its pool.

    timeout_s bounds joins and the default waits; a dead sender shows up as TransferTimeout.
    slots: requests in flight at once (each takes layers + 1 of the engine's immediate values).
    request_timeout_s: a request not complete by then fails (default 20 x timeout_s).
    quarantine_s: how long a failed request's slot rests (default 2 x timeout_s: the sender's posted
    writes end within its engine's timeout). channel_key: an optional secret shared with the
    senders at set-up (backends.channel).
    """

    def __init__(
        self,
        pool: KvPool,
        *,
        name: str = "",
        timeout_s: float | None = None,
        slots: int = DEFAULT_SLOTS,
        request_timeout_s: float | None = None,
        quarantine_s: float | None = None,
        channel_key: bytes | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, not {slots}")
        self.pool = pool
        self.engine = pool.engine
        self.name = name
        self.timeout_s = self.engine.timeout_s if timeout_s is None else float(timeout_s)
        self.request_timeout_s = (
            20 * self.timeout_s if request_timeout_s is None else float(request_timeout_s)
        )
        self.quarantine_s = 2 * self.timeout_s if quarantine_s is None else float(quarantine_s)
        self.slots = slots
        self._lock = threading.Lock()
        self._joins: dict[bytes, Future[None]] = {}
        self._welcomed: set[bytes] = set()  # senders whose welcome arrived: only they get grants
        self._requests: dict[str, IncomingRequest] = {}
        self._free: deque[int] = deque(range(slots))
        self._resting: deque[tuple[float, int]] = deque()  # (until, slot) of failed requests, in order
        self.channel = self.engine.channel(
            wire.CHANNEL, imms=slots * (pool.geometry.layers + 1), key=channel_key
        )
        self.channel.on_message(self._on_message)

    def join(self, sender: bytes, timeout_s: float | None = None) -> None:
        """Introduce this pool to a sender (hello/welcome); KvError if it rejects, timeout if silent.

        The hello carries no descriptor (geometry, name and immediate range only): memory is granted
        per request, and only once the sender's welcome arrived on this channel (with a channel key,
        that welcome carried the key's tag).
        """
        fut: Future[None] = Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            self._joins[sender] = fut
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout  # one bound for sending the hello and for the answer
        try:
            self.channel.send_json(
                sender,
                wire.HELLO,
                geometry=self.pool.geometry.to_dict(),
                name=self.name,
                imms=self.channel.imms.to_json(),
            ).result(timeout)
            fut.result(max(0.0, deadline - time.monotonic()))
        except TimeoutError as exc:
            with self._lock:
                if self._joins.get(sender) is fut:
                    del self._joins[sender]
            raise TransferTimeout(
                f"KV join: sender {_label(sender)} did not answer within {timeout:g}s"
            ) from exc

    def leave(self, sender: bytes) -> None:
        """Tell a sender this receiver is gone; its requests there fail on the sender side."""
        with self._lock:
            self._welcomed.discard(sender)
        try:
            self.channel.send_json(sender, wire.BYE).result(self.timeout_s)
        except TimeoutError as exc:
            raise TransferTimeout(
                f"KV leave: sender {_label(sender)} did not take the bye within {self.timeout_s:g}s"
            ) from exc

    def request(self, sender: bytes, request_id: str, dst_pages: Sequence[int]) -> IncomingRequest:
        """Ask `sender` for request_id's K/V into dst_pages of every layer of this pool.

        The sender must have welcomed this receiver (`join`); it is granted write access to exactly
        these pages, until the request settles.
        """
        pages = self.pool.geometry.check_pages(dst_pages, f"KV request {request_id}")
        self._expire_requests()
        with self._lock:
            if sender not in self._welcomed:
                raise KvError(
                    f"KV request {request_id}: sender {_label(sender)} has not welcomed this receiver "
                    "(join it first)"
                )
            if request_id in self._requests:
                raise KvError(f"KV request {request_id} is already pending on this receiver")
            slot = self._take_slot()
            req = IncomingRequest(self, request_id, sender, slot, pages)
            self._requests[request_id] = req
        req.done.add_done_callback(lambda f: self._finished(req, f))
        try:
            grant = self._grant(req, pages)
        except TransferError as exc:
            err = KvError(f"KV request {request_id}: could not grant its pages ({exc})")
            fail(req.done, err)
            raise err from exc
        finally:
            if req.done.done():  # settled meanwhile (e.g. the receiver closed): nothing stays granted
                req.revoke()
        parts = wire.parts(wire.runs(pages), grant)
        for i, (part, items) in enumerate(parts):
            self.channel.send_json(
                sender, wire.WANT, rid=request_id, slot=slot, part=i, parts=len(parts), pages=part,
                grant=items,
            ).add_done_callback(
                lambda f: settle_error(req.done, f, f"KV request {request_id}: want to {_label(sender)}")
            )
        return req

    def _grant(self, req: IncomingRequest, pages: list[int]) -> list[list[Any]]:
        """Register write-only regions for exactly the request's pages: per range of pages adjacent in
        memory, one per layer and half. Returns the want's grant items [start, count, regions]."""
        geo = self.pool.geometry
        out: list[list[Any]] = []
        for start, count in wire.runs(sorted(set(pages))):
            regions: list[list[int]] = []
            for layer in range(geo.layers):
                region, base = self.pool.layer_region(layer)
                for kv in range(geo.halves):
                    ptr = region.ptr + base + (kv * geo.pages + start) * geo.page_bytes
                    grant = self.engine.register((ptr, count * geo.page_bytes), "write")
                    req.grants.append(grant)
                    regions.append([grant.descriptor.base, *grant.descriptor.keys])
            out.append([start, count, regions])
        return out

    def close(self) -> None:
        """Stop receiving (the channel closes; pending requests fail; the pool and engine stay)."""
        self.channel.close()

    def _take_slot(self) -> int:
        """Under the lock: a free slot, its counts dropped first.

        Nothing may count for a slot before its want is sent: what is there is stale (a failed
        request's late writes) or was written ahead by a peer, and must not complete this request.
        """
        now = time.monotonic()
        while self._resting and self._resting[0][0] <= now:
            self._free.append(self._resting.popleft()[1])
        if not self._free:
            raise KvError(
                f"all {self.slots} request slots are busy or resting ({len(self._resting)} resting after a "
                f"failure; they come back within {self.quarantine_s:g}s)"
            )
        slot = self._free.popleft()
        layers = self.pool.geometry.layers
        self.channel.forget(wire.imm_index(slot, 0, layers), layers + 1)
        return slot

    def _expire_requests(self) -> None:
        """Fail requests past their request_timeout_s (their slots then rest and come back)."""
        now = time.monotonic()
        with self._lock:
            due = [r for r in self._requests.values() if r.deadline <= now]
        for req in due:
            req._expire_if_due()

    def _finished(self, req: IncomingRequest, done: Future[None]) -> None:
        """A request settled: revoke its grants; free its slot, or rest it and tell the sender to stop
        when it failed."""
        req.revoke()
        failed = done.exception() is not None
        with self._lock:
            if self._requests.get(req.request_id) is req:
                del self._requests[req.request_id]
            if failed:
                self._resting.append((time.monotonic() + self.quarantine_s, req.slot))
            else:
                self._free.append(req.slot)
        if failed and not self.channel.closed:
            try:
                self.channel.send_json(req._sender, wire.CANCEL, rid=req.request_id).add_done_callback(
                    log_failure(f"KV receiver: cancel of {req.request_id}")
                )
            except (TransferError, ValueError) as exc:
                log.debug("KV receiver: could not cancel %s at its sender: %s", req.request_id, exc)

    def _on_message(self, message: Message) -> None:
        try:
            msg = message.fields()
        except ValueError as exc:
            log.warning("KV receiver: dropped a malformed message (%s)", exc)
            return
        kind, sender = message.kind, message.sender
        if kind in (wire.WELCOME, wire.REJECT):
            with self._lock:
                fut = self._joins.pop(sender, None)
            if fut is None:
                log.warning("KV receiver: %s from a sender it did not join", kind)
            elif kind == wire.WELCOME:
                with self._lock:
                    self._welcomed.add(sender)
                fut.set_result(None)
            else:
                fut.set_exception(KvError(f"KV join: sender {_label(sender)} refused: {msg.get('reason')}"))
        elif kind == wire.FAILED:
            with self._lock:
                req = self._requests.get(str(msg.get("rid")))
            if req is not None and req._sender == sender:  # only the sender asked may refuse it
                fail(req.done, KvError(f"KV request {req.request_id}: sender refused: {msg.get('reason')}"))
        else:
            log.warning("KV receiver: unknown message kind %r", kind)


def _label(address: bytes) -> str:
    return address[-8:].hex()
