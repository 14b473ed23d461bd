"""The inference side of a weight-update session: two parameter slots, flipped on completion.

Consistency rule (double buffer and flip): readers compute on the *active* slot; trainers write the
next version into the *free* slot with one-sided writes; once every contributing trainer's
completion immediate for that version has arrived, the receiver makes the free slot active (an
index swap under a lock, so a reader gets one slot or the other, never a mix). The slot that was
active is offered for the next version (READY) only after the last reader that took it has
released it. A trainer that dies mid-update never completes, so after `update_timeout_s` the
update is abandoned and the receiver stays on the old version, whose slot was never touched; the
free slot is re-registered before it is offered again, so a trainer that was slow rather than dead
cannot land its late writes in it (they fail at the old keys). Only the roster's trainers are heard
(Message.sender is proven by the channel), and a BEGIN may jump at most MAX_VERSION_JUMP ahead.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

import backends.rl.delta as delta_codec
import backends.rl.messages as protocol
from backends.channel import Message
from backends.engine import Region, TransferEngine
from backends.errors import TransferError
from backends.layout import views
from backends.rl.schedule import RankShard, ReceiverSchedule, build_receiver_schedule
from backends.rl.spec import (
    DEFAULT_MAX_REGION_BYTES,
    RLError,
    TensorSpec,
    TrainerRank,
    check_tp,
    shard_layout,
    specs_digest,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One consistent version of the weights, valid while its `acquire()` block runs."""

    version: int
    slot: int
    tensors: dict[str, torch.Tensor]


@dataclass(slots=True)
class _Pending:
    version: int
    deadline: float
    slot: int = 0  # the free slot it is written into
    base: int | None = None  # the version that slot held when the update began (None: torn)
    begun: set[int] = field(default_factory=set)  # trainers whose BEGIN arrived
    deltas: dict[int, dict[str, Any]] = field(default_factory=dict)  # trainer -> its BEGIN's delta
    landed: bool = False  # every contributor's completion immediate arrived


class SlotReaders:
    """The reader side of two weight slots: readers pin the active slot, the writer fills the other and
    flips (RLReceiver on host memory, backends.rl.device's device slots). The owner sets
    `_cond`, `_active`, `_version`, `_readers` (per slot) and `_views` (per slot)."""

    _cond: threading.Condition
    _active: int
    _version: int
    _readers: list[int]
    _views: Any

    @property
    def version(self) -> int:
        """The version readers get now."""
        with self._cond:
            return self._version

    @contextlib.contextmanager
    def acquire(self) -> Iterator[Snapshot]:
        """Pin the active slot for one computation: its bytes do not change until the block exits."""
        with self._cond:
            slot, version = self._active, self._version
            self._readers[slot] += 1
        try:
            yield Snapshot(version, slot, self._views[slot])
        finally:
            with self._cond:
                self._readers[slot] -= 1
                if self._readers[slot] == 0:
                    self._cond.notify_all()


class RLReceiver(SlotReaders):
    """One inference rank taking weight updates from the session's trainers.

    `buffers` are the rank's existing flat parameter regions (the `backends.layout` placement of its
    shards), registered in place as slot 0; slot 1 is a copy. Both slots are registered for remote
    write only, and their descriptors go only to the session's trainers (in HELLO). The session
    talks on its own channel, whose immediate range (advertised in HELLO) carries completions.
    channel_key: a secret every member of the session got at set-up (optional; backends.channel).
    delta_fraction: above 0, a write-only staging area per contributing trainer of this fraction of the
    bytes it writes here: a trainer with `deltas` then sends only the words changed since the version
    the free slot holds, when they fit, and the receiver applies them and checks the whole slot
    against the trainer's digest before it flips (backends.rl.delta).
    """

    def __init__(
        self,
        engine: TransferEngine,
        *,
        session: str,
        specs: Sequence[TensorSpec],
        trainers: Sequence[TrainerRank],
        index: int,
        tp_size: int = 1,
        tp_rank: int = 0,
        buffers: Sequence[torch.Tensor] | None = None,
        max_region_bytes: int = DEFAULT_MAX_REGION_BYTES,
        version: int = 0,
        update_timeout_s: float = 60.0,
        on_update_begin: Callable[[int], None] | None = None,
        channel_key: bytes | None = None,
        delta_fraction: float = 0.0,
    ) -> None:
        check_tp(tp_size, tp_rank, f"receiver {index}")
        if not 0.0 <= delta_fraction <= 1.0:
            raise RLError(f"receiver {index}: delta_fraction must be in [0, 1], not {delta_fraction}")
        if update_timeout_s <= 0:
            raise RLError(f"receiver {index}: update_timeout_s must be positive, not {update_timeout_s}")
        self.engine = engine
        self.session = session
        self.index = index
        self.specs = tuple(specs)
        self.trainers = tuple(trainers)
        self.update_timeout_s = float(update_timeout_s)
        self._on_update_begin = on_update_begin
        self.layout = shard_layout(
            self.specs, tp_size=tp_size, tp_rank=tp_rank, max_region_bytes=max_region_bytes
        )
        self._tp = (tp_size, tp_rank, max_region_bytes)
        t0 = time.perf_counter()
        self.schedule: ReceiverSchedule = build_receiver_schedule(
            self.specs,
            [
                RankShard(
                    t.tp_size,
                    t.tp_rank,
                    shard_layout(
                        self.specs, tp_size=t.tp_size, tp_rank=t.tp_rank, max_region_bytes=t.max_region_bytes
                    ),
                )
                for t in self.trainers
            ],
            RankShard(tp_size, tp_rank, self.layout),
            receiver_index=index,
        )
        self.schedule_seconds = time.perf_counter() - t0
        self.contributors = self.schedule.contributors
        slot0 = self._check_buffers(buffers)
        # the copy also pre-faults slot 1; page-locked where slot 0 is (a GPU receiver stages through both)
        self._slots = (slot0, [torch.empty_like(b, pin_memory=b.is_pinned()).copy_(b) for b in slot0])
        self._views = tuple(views(self.layout, s) for s in self._slots)
        self._regions: list[list[Region]] = []
        self._staging: dict[int, tuple[torch.Tensor, Region]] = {}  # trainer -> its delta staging area
        try:
            for slot in self._slots:
                self._regions.append([engine.register(b, "write") for b in slot])
            if delta_fraction > 0:
                for trainer, nbytes in self.schedule.bytes_by_trainer().items():
                    runs = self.schedule.runs_for(trainer)
                    if delta_codec.aligned(runs):
                        size = max(int(nbytes * delta_fraction), delta_codec.delta_capacity_bytes(runs, 0))
                        area = torch.empty(size, dtype=torch.uint8)
                        self._staging[trainer] = (area, engine.register(area, "write"))
        except BaseException:
            self._release()
            raise
        self._cond = threading.Condition()
        self._active = 0
        self._version = version
        self._readers = [0, 0]
        self._holds: list[int | None] = [version, version]  # the version each slot's bytes are (None: torn)
        self._pending: _Pending | None = None
        self._abandoned_up_to = version
        self._announce = False
        self._confirmed = version  # the last version a READY told the trainers about
        self._inbox: deque[Message] = deque()
        self._closed = False
        self._rekey = False  # an abandoned update may still write the free slot: re-key it before READY
        self._roster = {t.address: i for i, t in enumerate(self.trainers)}
        self.rejected: str | None = None
        self.dropped_by: dict[int, str] = {}  # trainer index -> why it dropped this receiver
        self.applied = 0
        self.applied_as_delta = 0  # updates where at least one trainer sent only changed words
        self.abandoned = 0
        self.foreign = 0  # messages from engines outside the roster, dropped
        self.refused = 0  # BEGINs past MAX_VERSION_JUMP or a full inbox, dropped
        self.channel = engine.channel(protocol.channel_name(session), imms=protocol.IMMS, key=channel_key)
        self.channel.on_message(self._on_message)
        self._thread = threading.Thread(target=self._control_loop, name=f"rl-receiver-{index}", daemon=True)
        self._thread.start()
        self._hello()

    # ----- reader side --------------------------------------------------------------------------
    def wait_version(self, version: int, timeout_s: float) -> bool:
        """Block until readers get `version` or later; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._version < version:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    # ----- protocol -----------------------------------------------------------------------------
    def _hello(self) -> None:
        tp_size, tp_rank, mrb = self._tp
        descs = [[base64.b64encode(r.descriptor.to_bytes()).decode() for r in slot] for slot in self._regions]
        with self._cond:
            version, free = self._version, 1 - self._active
            holds = self._holds[free]
        hello = {
            "receiver": self.index,
            "tp": [tp_size, tp_rank],
            "max_region_bytes": mrb,
            "digest": specs_digest(self.specs),
            "imms": self.channel.imms.to_json(),
            "slots": descs,
            "contributors": list(self.contributors),
            "version": version,
            "slot": free,
            "holds": holds,
        }
        if self._staging:
            hello["delta"] = {
                str(t): base64.b64encode(region.descriptor.to_bytes()).decode()
                for t, (_, region) in self._staging.items()
            }
        futures = [(i, protocol.send(self.channel, t.address, protocol.HELLO, **hello))
                   for i, t in enumerate(self.trainers)]
        for i, fut in futures:
            try:
                fut.result(timeout=self.engine.timeout_s + 5)
            except (TransferError, TimeoutError) as exc:
                self.close()
                raise RLError(f"receiver {self.index}: HELLO to trainer {i} failed: {exc}") from exc

    def _on_message(self, message: Message) -> None:
        # Progress thread: queue only, and only what the roster's trainers send.
        with self._cond:
            if message.sender not in self._roster:
                self.foreign += 1
                return
            if len(self._inbox) >= protocol.MAX_INBOX:
                self.refused += 1
                return
            self._inbox.append(message)
            self._cond.notify_all()

    def _control_loop(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._closed
                    or self._inbox
                    or self._announce_due()
                    or self._confirm_due()
                    or self._overdue()
                    or self._finish_due()
                ):
                    self._cond.wait(self._wait_s())
                if self._closed:
                    return
                inbox = list(self._inbox)
                self._inbox.clear()
                if self._overdue():
                    self._abandon()
                finishing = self._pending if self._finish_due() else None
                ready: tuple[int, int | None] | None = None
                free_holds: int | None = None
                if self._announce_due():
                    self._announce = False
                    ready = (self._version, 1 - self._active)
                elif self._confirm_due():  # flipped, but a reader still holds the old slot
                    ready = (self._version, None)
                if ready is not None:
                    self._confirmed = ready[0]
                    if ready[1] is not None:
                        free_holds = self._holds[ready[1]]
                rekey = ready is not None and ready[1] is not None and self._rekey
                if rekey:
                    self._rekey = False
            if finishing is not None:  # before any BEGIN in this batch, which could reuse its slot
                self._finish(finishing)
            for message in inbox:
                self._handle(message)
            if ready is not None:
                extra: dict[str, Any] = {} if ready[1] is None else {"holds": free_holds}
                if rekey:
                    assert ready[1] is not None
                    extra["descs"] = self._rekey_slot(ready[1])
                self._broadcast(protocol.READY, version=ready[0], slot=ready[1], **extra)

    def _rekey_slot(self, slot: int) -> list[str]:
        """Register the free slot anew and release its old registrations: writes still in flight for an
        abandoned version then fail at the old keys instead of landing in the next version's bytes."""
        fresh = [self.engine.register(b, "write") for b in self._slots[slot]]
        old, self._regions[slot] = self._regions[slot], fresh
        for region in old:
            region.close()
        log.info("receiver %d: slot %d re-keyed after an abandoned update", self.index, slot)
        return [base64.b64encode(r.descriptor.to_bytes()).decode() for r in fresh]

    def _finish_due(self) -> bool:
        p = self._pending
        return p is not None and p.landed and p.begun.issuperset(self.contributors)

    def _finish(self, pending: _Pending) -> None:
        """Apply the deltas of a landed update into its slot and check them; flip, or abandon it."""
        error = None
        try:
            for trainer, info in sorted(pending.deltas.items()):
                self._apply_delta(pending, trainer, info)
        except (RLError, ValueError, RuntimeError) as exc:
            error = exc
        with self._cond:
            if self._pending is not pending:
                return
            if error is not None:
                log.error("receiver %d: version %d not applied: %s", self.index, pending.version, error)
                self._abandon(why=str(error))
                self._cond.notify_all()
                return
        if pending.deltas:
            self.applied_as_delta += 1
        self._complete(pending, None, landed=True)

    def _apply_delta(self, pending: _Pending, trainer: int, info: dict[str, Any]) -> None:
        base, nbytes, digest = info.get("base"), info.get("bytes"), info.get("digest")
        staged = self._staging.get(trainer)
        if staged is None:
            raise RLError(f"trainer {trainer} sent a delta, but has no staging area here")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= staged[0].numel():
            raise RLError(f"trainer {trainer}: delta of {nbytes!r} bytes does not fit its staging area")
        if not isinstance(digest, str):
            raise RLError(f"trainer {trainer}: a delta without its digest")
        holds = pending.base
        if base != holds:
            raise RLError(
                f"trainer {trainer}: a delta from version {base!r}, but slot {pending.slot} held {holds}"
            )
        runs = self.schedule.runs_for(trainer)
        slot = self._slots[pending.slot]
        delta_codec.apply(runs, staged[0][:nbytes], slot)
        got = delta_codec.runs_digest(runs, slot, source=False)
        if got != digest:
            raise RLError(
                f"trainer {trainer}: slot {pending.slot} after its delta has digest {got}, not {digest}"
            )

    def _confirm_due(self) -> bool:
        return self._confirmed != self._version

    def _wait_s(self) -> float:
        if self._pending is None:
            return 1.0
        return max(0.0, min(1.0, self._pending.deadline - time.monotonic()))

    def _announce_due(self) -> bool:
        return self._announce and self._readers[1 - self._active] == 0

    def _overdue(self) -> bool:
        return self._pending is not None and time.monotonic() >= self._pending.deadline

    def _abandon(self, why: str | None = None) -> None:
        pending = self._pending
        assert pending is not None
        log.warning(
            "receiver %d: update to version %d abandoned (%s); staying on version %d",
            self.index,
            pending.version,
            why or f"a trainer did not complete within {self.update_timeout_s:g}s",
            self._version,
        )
        self._pending = None
        self._abandoned_up_to = max(self._abandoned_up_to, pending.version)
        self.abandoned += 1
        self._announce = True  # the free slot is garbage now but free: offer it again, re-keyed
        self._rekey = True

    def _handle(self, message: Message) -> None:
        try:
            msg = protocol.decode(message)
            kind = msg["kind"]
            if kind == protocol.BEGIN:
                delta = msg.get("delta")
                self._begin(
                    protocol.field(msg, "version", int),
                    self._roster[message.sender],
                    delta if isinstance(delta, dict) else None,
                )
            elif kind == protocol.REJECT:
                self.rejected = str(msg.get("reason"))[:2000]
                log.error("receiver %d: a trainer rejected this receiver: %s", self.index, self.rejected)
            elif kind == protocol.DROPPED:
                trainer = self._roster[message.sender]
                self.dropped_by[trainer] = str(msg.get("reason"))[:2000]
                log.error("receiver %d: trainer %d dropped it: %s", self.index, trainer, msg.get("reason"))
            else:
                log.debug("receiver %d: ignoring %s message", self.index, kind)
        except RLError as exc:
            log.warning("receiver %d: %s", self.index, exc)

    def _begin(self, version: int, trainer: int = 0, delta: dict[str, Any] | None = None) -> None:
        with self._cond:
            if self._pending is not None and self._pending.version == version:
                self._pending.begun.add(trainer)  # a second trainer's BEGIN for the update under way
                if delta is not None:
                    self._pending.deltas[trainer] = delta
                self._cond.notify_all()
                return
            if version <= max(self._version, self._abandoned_up_to):
                return  # stale
            if version - max(self._version, self._abandoned_up_to) > protocol.MAX_VERSION_JUMP:
                self.refused += 1
                log.warning("receiver %d: BEGIN of version %d jumps more than %d past %d; ignored",
                            self.index, version, protocol.MAX_VERSION_JUMP, self._version)
                return
            if self._pending is not None:
                if self._pending.version >= version:
                    return
                log.warning(
                    "receiver %d: version %d begins while %d is incomplete; abandoning %d",
                    self.index,
                    version,
                    self._pending.version,
                    self._pending.version,
                )
                self._abandoned_up_to = self._pending.version
                self.abandoned += 1
                self._rekey = True
            pending = _Pending(version, time.monotonic() + self.update_timeout_s, slot=1 - self._active)
            pending.begun.add(trainer)
            if delta is not None:
                pending.deltas[trainer] = delta
            self._pending = pending
            pending.base = self._holds[pending.slot]
            self._holds[pending.slot] = None  # torn until the update completes
        log.debug("receiver %d: update to version %d begins", self.index, version)
        if self._on_update_begin is not None:
            self._on_update_begin(version)
        if not self.contributors:
            self._complete(pending, None)
            return
        fut = self.channel.expect(protocol.imm_index(version), len(self.contributors))
        fut.add_done_callback(lambda f: self._complete(pending, f))

    def _complete(self, pending: _Pending, fut: Future[None] | None, *, landed: bool = False) -> None:
        if fut is not None and fut.exception() is not None:
            return
        with self._cond:
            if self._pending is not pending:
                return  # abandoned meanwhile: its slot will be rewritten by the next update
            if self._staging and not landed:
                pending.landed = True  # the control thread applies any deltas, checks them, then flips
                self._cond.notify_all()
                return
            self._pending = None
            self._holds[pending.slot] = pending.version
            self._active = 1 - self._active
            self._version = pending.version
            self.applied += 1
            self._announce = True
            self._cond.notify_all()
        log.info("receiver %d: now on version %d", self.index, pending.version)

    def _broadcast(self, kind: str, **fields: Any) -> None:  # noqa: ANN401
        for i, t in enumerate(self.trainers):
            try:
                protocol.send(self.channel, t.address, kind, receiver=self.index, **fields).add_done_callback(
                    self._sent(kind, i)
                )
            except TransferError as exc:
                log.warning("receiver %d: %s to trainer %d failed: %s", self.index, kind, i, exc)

    def _sent(self, kind: str, trainer: int) -> Callable[[Future[None]], None]:
        def check(fut: Future[None]) -> None:
            if fut.exception() is not None:
                log.warning(
                    "receiver %d: %s to trainer %d failed: %s", self.index, kind, trainer, fut.exception()
                )

        return check

    # ----- setup and teardown -------------------------------------------------------------------
    def _check_buffers(self, buffers: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        sizes = self.layout.region_sizes
        if buffers is None:
            return [torch.zeros(n, dtype=torch.uint8) for n in sizes]
        got = [int(b.numel() * b.element_size()) for b in buffers]
        if len(got) != len(sizes) or any(g < n for g, n in zip(got, sizes, strict=False)):
            raise RLError(
                f"receiver {self.index}: buffers of {got} bytes do not hold "
                f"the layout's regions {list(sizes)}"
            )
        out = []
        for b in buffers:
            if b.device.type != "cpu" or not b.is_contiguous():
                raise RLError(f"receiver {self.index}: parameter buffers must be contiguous host memory")
            out.append(b.view(torch.uint8).view(-1))
        return out

    def _release(self) -> None:
        for slot in self._regions:
            for region in slot:
                region.close()
        self._regions = []
        for _, region in self._staging.values():
            region.close()
        self._staging = {}

    def close(self) -> None:
        """Stop taking updates and deregister both slots (the engine stays open)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.channel.close()
        self._release()

    def __enter__(self) -> RLReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
