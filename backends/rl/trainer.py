"""The trainer side of a weight-update session: post the scheduled writes, then one immediate each.

Every trainer rank runs an `RLTrainer` over its own engine and its own shard buffers. Receivers
join by sending HELLO; the trainer then computes that receiver's schedule once (the static part)
and keeps only its own runs. `update(version)` waits for each receiver's READY (its free slot),
sends BEGIN, posts the runs as one-sided writes into that slot, and when they have all completed
sends one immediate for the version. A write that fails fast (a reset connection) is retried
(RETRIES more times, with backoff, within the update's timeout); a receiver whose writes still
fail, or time out (it died, or stopped answering within the engine's timeout), is dropped from the
session and told so (DROPPED); the others are unaffected.
A receiver index belongs to the address that joined under it while that receiver is live, and its
READY counts only from that address; a re-keyed slot's new descriptors come with READY.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

import backends.rl.delta as delta_codec
import backends.rl.messages as protocol
from backends.channel import ImmRange, Message
from backends.descriptor import MemoryRegionDescriptor
from backends.engine import Region, TransferEngine
from backends.errors import EngineClosed, RemoteAccessError, TransferError, TransferTimeout
from backends.layout import views
from backends.rl.schedule import RankShard, Run, build_receiver_schedule
from backends.rl.spec import RLError, TensorSpec, TrainerRank, check_tp, shard_layout, specs_digest

log = logging.getLogger(__name__)

RETRIES = 3  # more attempts at a receiver's share of an update after a TransferError
RETRY_BACKOFF_S = 0.25  # before the first retry; doubled for each next one (a connection may be re-made)

@dataclass(frozen=True, slots=True)
class UpdateResult:
    """What one trainer saw of one update: per receiver applied, dropped or failed (with why)."""

    version: int
    applied: tuple[int, ...]
    dropped: dict[int, str]
    failed: dict[int, str]
    seconds: float
    bytes_posted: int
    as_delta: tuple[int, ...] = ()  # receivers sent only the changed words (the rest got whole runs)


@dataclass(slots=True)
class _ReceiverState:
    index: int
    address: bytes
    slots: list[list[MemoryRegionDescriptor]]
    imms: ImmRange
    runs: tuple[Run, ...]
    version: int
    free_slot: int | None
    schedule_seconds: float
    alive: bool = True
    reason: str = ""
    bytes_per_update: int = field(default=0)
    holds: int | None = None  # the version its free slot holds (READY), None: unknown or torn
    delta_desc: MemoryRegionDescriptor | None = None  # its staging region for this trainer's deltas
    delta_out: tuple[torch.Tensor, Region] | None = None  # this trainer's encode buffer for it


@dataclass(frozen=True, slots=True)
class _Delta:
    base: int
    nbytes: int
    digest: str


class RLTrainer:
    """One trainer rank: owns its shard buffers (registered in place) and its part of every update.

    `trainers` is the whole trainer roster, the same list every member got; `index` is this rank's
    position in it. The training loop writes new weights into `tensors` (views of `buffers`) between
    updates, never during one. The session talks on its own channel of the engine; channel_key is
    an optional secret every member of the session got at set-up (backends.channel).
    deltas: keep host copies of the last two versions sent (twice the shard's memory) and send a
    receiver that offers a delta staging area only the words changed since the version its free slot
    holds, when that is smaller than its staging area (backends.rl.delta).
    """

    def __init__(
        self,
        engine: TransferEngine,
        *,
        session: str,
        specs: Sequence[TensorSpec],
        trainers: Sequence[TrainerRank],
        index: int,
        buffers: Sequence[torch.Tensor],
        version: int = 0,
        timeout_s: float = 60.0,
        channel_key: bytes | None = None,
        deltas: bool = False,
    ) -> None:
        if not 0 <= index < len(trainers):
            raise RLError(f"trainer index {index} is not in the roster of {len(trainers)}")
        me = trainers[index]
        check_tp(me.tp_size, me.tp_rank, f"trainer {index}")
        if engine.provider == "shm" and engine.domains > 1:
            # shm completes plain writes when queued: only one endpoint (FIFO to the peer) keeps the
            # completion immediate behind the data it announces.
            raise RLError(f"trainer {index}: an shm engine needs exactly one domain, not {engine.domains}")
        if me.address != engine.address:
            raise RLError(f"trainer {index}: the roster's address is not this engine's address")
        self.engine = engine
        self.session = session
        self.index = index
        self.specs = tuple(specs)
        self.digest = specs_digest(self.specs)
        self.timeout_s = float(timeout_s)
        self._shards = [
            RankShard(
                t.tp_size,
                t.tp_rank,
                shard_layout(
                    self.specs, tp_size=t.tp_size, tp_rank=t.tp_rank, max_region_bytes=t.max_region_bytes
                ),
            )
            for t in trainers
        ]
        self.layout = self._shards[index].layout
        sizes = self.layout.region_sizes
        got = [int(b.numel() * b.element_size()) for b in buffers]
        if len(got) != len(sizes) or any(g < n for g, n in zip(got, sizes, strict=False)):
            raise RLError(
                f"trainer {index}: buffers of {got} bytes do not hold the layout's regions {list(sizes)}"
            )
        self.buffers = [b.view(torch.uint8).view(-1) for b in buffers]
        self.tensors = views(self.layout, self.buffers)
        self._src: list[Region] = [engine.register(b, "read") for b in self.buffers]
        self._snapshots = delta_codec.Snapshots() if deltas else None
        self._cond = threading.Condition()
        self._receivers: dict[int, _ReceiverState] = {}
        self._inbox: deque[Message] = deque()
        self._closed = False
        self._version = version
        self.refused = 0  # messages dropped because the control inbox was full (MAX_INBOX)
        self.channel = engine.channel(protocol.channel_name(session), key=channel_key)
        self.channel.on_message(self._on_message)
        self._thread = threading.Thread(target=self._control_loop, name=f"rl-trainer-{index}", daemon=True)
        self._thread.start()

    # ----- public state -------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The last version this trainer posted."""
        with self._cond:
            return self._version

    def receiver_versions(self) -> dict[int, int]:
        """The version each live receiver last reported serving (HELLO or READY)."""
        with self._cond:
            return {i: r.version for i, r in self._receivers.items() if r.alive}

    def dropped(self) -> dict[int, str]:
        """Receivers dropped from the session, with the reason."""
        with self._cond:
            return {i: r.reason for i, r in self._receivers.items() if not r.alive}

    @property
    def schedule_seconds(self) -> float:
        """Time spent computing schedules (once per receiver, at its HELLO)."""
        with self._cond:
            return sum(r.schedule_seconds for r in self._receivers.values())

    def wait_receivers(self, count: int, timeout_s: float) -> None:
        """Block until `count` receivers have joined; RLError naming how many did otherwise."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while sum(r.alive for r in self._receivers.values()) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RLError(
                        f"trainer {self.index}: {len(self._receivers)} of {count} receivers joined "
                        f"within {timeout_s:g}s"
                    )
                self._cond.wait(left)

    # ----- the update ---------------------------------------------------------------------------
    def update(
        self, version: int, *, timeout_s: float | None = None, wait_applied: bool = True
    ) -> UpdateResult:
        """Write this rank's share of `version` into every live receiver's free slot.

        Returns once every receiver has been written (or dropped) and, with wait_applied, has
        confirmed it serves `version` (or has abandoned it). Bounded by timeout_s.
        """
        t0 = time.perf_counter()
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            if version <= self._version:
                raise RLError(
                    f"trainer {self.index}: version {version} is not above the last one ({self._version})"
                )
            if version - self._version > protocol.MAX_VERSION_JUMP:
                raise RLError(
                    f"trainer {self.index}: version {version} jumps more than {protocol.MAX_VERSION_JUMP} "
                    f"past {self._version} (receivers ignore such a BEGIN)"
                )
            if version & protocol.VERSION_MASK == 0:
                raise RLError(f"trainer {self.index}: version {version} wraps the 24-bit immediate to 0")
            self._version = version
            waiting = {i for i, r in self._receivers.items() if r.alive}
        deliveries: dict[int, Future[None]] = {}
        slots: dict[int, int] = {}
        deltas: dict[int, _Delta] = {}
        digests: dict[tuple[Run, ...], str] = {}  # per run list (receivers of one layout share it)
        changed: dict[int, list[torch.Tensor] | None] = {}  # per base version, the words changed since
        # it (None: more than a delta could carry)
        posted = 0
        dropped: dict[int, str] = {}
        failed: dict[int, str] = {}
        while waiting:
            with self._cond:
                start = []
                for i in sorted(waiting):
                    rec = self._receivers[i]
                    if not rec.alive:
                        waiting.discard(i)
                        dropped[i] = rec.reason
                    elif rec.free_slot is not None and rec.version < version:
                        start.append((rec, rec.free_slot))
                        rec.free_slot = None
                        waiting.discard(i)
                if not start and waiting:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(min(left, 0.5))
                    continue
            for rec, slot in start:
                found = self._encode_delta(rec, changed, digests)
                if found is not None:
                    deltas[rec.index] = found
                deliveries[rec.index] = self._post(rec, slot, version, found)
                slots[rec.index] = slot
                posted += rec.bytes_per_update if found is None else found.nbytes
        if self._snapshots is not None:  # while the writes are in flight
            known = {b: words for b, words in changed.items() if words is not None}
            base = min(known, default=None)
            self._snapshots.record(version, self.buffers, None if base is None else (base, known[base]))
        for i in waiting:
            failed[i] = (
                f"no free slot (READY) within the update timeout; it serves {self._receivers[i].version}"
            )
        for i, fut in deliveries.items():
            attempts = 0
            while True:
                try:
                    fut.result(timeout=max(0.0, deadline - time.monotonic()))
                except TransferError as exc:
                    # A timeout means the engine already waited timeout_s on an unresponsive peer:
                    # not transient. Errors that come fast (a reset connection) are retried.
                    transient = not isinstance(exc, (TransferTimeout, RemoteAccessError, EngineClosed))
                    if transient and attempts < RETRIES and time.monotonic() < deadline:
                        attempts += 1
                        log.warning("trainer %d: update %d to receiver %d failed (%s); retry %d of %d",
                                    self.index, version, i, exc, attempts, RETRIES)
                        backoff = RETRY_BACKOFF_S * 2 ** (attempts - 1)
                        time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
                        fut = self._post(self._receivers[i], slots[i], version, deltas.get(i))
                        posted += deltas[i].nbytes if i in deltas else self._receivers[i].bytes_per_update
                        continue
                    reason = f"update {version}: {exc} (after {attempts + 1} attempts)"
                    self._drop(i, reason)
                    dropped[i] = reason
                except FutureTimeout:
                    failed[i] = f"update {version}: timed out"
                break
        applied: list[int] = []
        pending = [i for i in deliveries if i not in dropped and i not in failed]
        if not wait_applied:
            applied = pending
        else:
            with self._cond:
                while pending:
                    for i in list(pending):
                        rec = self._receivers[i]
                        if rec.version >= version:
                            applied.append(i)
                            pending.remove(i)
                        elif not rec.alive:
                            dropped[i] = rec.reason
                            pending.remove(i)
                        elif rec.free_slot is not None:
                            failed[i] = (
                                f"abandoned version {version} (a trainer did not complete); "
                                f"serves {rec.version}"
                            )
                            pending.remove(i)
                    left = deadline - time.monotonic()
                    if not pending or left <= 0:
                        break
                    self._cond.wait(min(left, 0.5))
            for i in pending:
                failed[i] = f"did not confirm version {version} in time"
        return UpdateResult(
            version=version,
            applied=tuple(sorted(applied)),
            dropped=dropped,
            failed=failed,
            seconds=time.perf_counter() - t0,
            bytes_posted=posted,
            as_delta=tuple(sorted(deltas)),
        )

    def _encode_delta(
        self,
        rec: _ReceiverState,
        changed: dict[int, list[torch.Tensor] | None],
        digests: dict[tuple[Run, ...], str],
    ) -> _Delta | None:
        """This update's delta for `rec` from the version its free slot holds, encoded into its send
        buffer; None where it gets whole runs (no staging area, base not kept, or too many changes)."""
        snaps = self._snapshots
        if snaps is None or rec.delta_desc is None or rec.holds is None or not rec.runs:
            return None
        base = snaps.get(rec.holds)
        if base is None:
            return None
        # never more than whole runs (a delta that large is sent whole), whatever the receiver offers
        size = min(rec.delta_desc.length, rec.bytes_per_update)
        if rec.holds not in changed:
            limit = size // (2 * delta_codec.WORD)
            changed[rec.holds] = delta_codec.changed_words(base, self.buffers, limit=limit)
        words = changed[rec.holds]
        if words is None:
            return None
        if rec.delta_out is None:
            out = torch.empty(size, dtype=torch.uint8)
            rec.delta_out = (out, self.engine.register(out, "read"))
        nbytes = delta_codec.encode(rec.runs, words, self.buffers, rec.delta_out[0])
        if nbytes is None:
            return None
        if rec.runs not in digests:
            digests[rec.runs] = delta_codec.runs_digest(rec.runs, self.buffers, source=True)
        return _Delta(base=rec.holds, nbytes=nbytes, digest=digests[rec.runs])

    def _post(
        self, rec: _ReceiverState, slot: int, version: int, delta: _Delta | None = None
    ) -> Future[None]:
        """BEGIN, every run (or the delta), then (once all completed) the immediate; the future covers
        all of it."""
        done: Future[None] = Future()
        done.set_running_or_notify_cancel()
        if not rec.runs:
            done.set_result(None)
            return done
        eng = self.engine
        descs = rec.slots[slot]
        lock = threading.Lock()
        futures: list[Future[None]] = []

        def fail(exc: BaseException) -> None:
            with lock:
                if done.done():
                    return
                done.set_exception(exc)

        def finish(f: Future[None]) -> None:
            exc = f.exception()
            if exc is not None:
                fail(exc)
            elif not done.done():
                done.set_result(None)

        outstanding = [0]

        def one_done(f: Future[None]) -> None:
            exc = f.exception()
            if exc is not None:
                fail(exc)
                return
            with lock:
                outstanding[0] -= 1
                last = outstanding[0] == 0
            if last and not done.done():
                try:
                    imm = rec.imms.value(protocol.imm_index(version))
                    eng.write_imm(imm, descs[0]).add_done_callback(finish)
                except TransferError as exc2:
                    fail(exc2)

        try:
            if delta is not None:
                assert rec.delta_out is not None
                assert rec.delta_desc is not None
                fields = {"base": delta.base, "bytes": delta.nbytes, "digest": delta.digest}
                futures.append(
                    protocol.send(self.channel, rec.address, protocol.BEGIN, version=version, delta=fields)
                )
                if delta.nbytes:
                    futures.append(eng.write(rec.delta_out[1], 0, delta.nbytes, rec.delta_desc, 0))
                outstanding[0] = len(futures)
                for f in futures:
                    f.add_done_callback(one_done)
                return done
            futures.append(protocol.send(self.channel, rec.address, protocol.BEGIN, version=version))
            src = self._src
            for run in rec.runs:
                if run.count == 1:
                    futures.append(
                        eng.write(
                            src[run.src_region],
                            run.src_offset,
                            run.length,
                            descs[run.dst_region],
                            run.dst_offset,
                        )
                    )
                else:
                    pages = range(run.count)
                    futures.append(
                        eng.write_paged(
                            src[run.src_region],
                            pages,
                            run.src_stride,
                            descs[run.dst_region],
                            pages,
                            run.dst_stride,
                            run.length,
                            src_offset=run.src_offset,
                            dst_offset=run.dst_offset,
                        )
                    )
        except TransferError as exc:
            fail(exc)
            return done
        outstanding[0] = len(futures)
        for f in futures:
            f.add_done_callback(one_done)
        return done

    def _drop(self, index: int, reason: str) -> None:
        """Drop a receiver from the session and tell it (best effort: it may be dead)."""
        with self._cond:
            rec = self._receivers.get(index)
            told = rec is not None and rec.alive
            if rec is not None and rec.alive:
                rec.alive = False
                rec.reason = reason
                log.warning("trainer %d: dropped receiver %d: %s", self.index, index, reason)
            self._cond.notify_all()
        if told:
            assert rec is not None
            try:
                protocol.send(self.channel, rec.address, protocol.DROPPED, reason=reason[:2000])
            except TransferError:
                log.debug("DROPPED to receiver %d failed", index, exc_info=True)

    # ----- messages -----------------------------------------------------------------------------
    def _on_message(self, message: Message) -> None:
        with self._cond:
            if len(self._inbox) >= protocol.MAX_INBOX:
                self.refused += 1
                return
            self._inbox.append(message)
            self._cond.notify_all()

    def _control_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._inbox:
                    self._cond.wait()
                if self._closed:
                    return
                inbox = list(self._inbox)
                self._inbox.clear()
            for message in inbox:
                try:
                    msg = protocol.decode(message)
                    if msg["kind"] == protocol.HELLO:
                        self._hello(message.sender, msg)
                    elif msg["kind"] == protocol.READY:
                        self._ready(message.sender, msg)
                except RLError as exc:
                    log.warning("trainer %d: %s", self.index, exc)

    def _ready(self, address: bytes, msg: dict[str, object]) -> None:
        index = protocol.field(msg, "receiver", int)
        version = protocol.field(msg, "version", int)
        slot = None if msg.get("slot") is None else protocol.field(msg, "slot", int) & 1
        with self._cond:
            rec = self._receivers.get(index)
            if rec is None or not rec.alive or rec.address != address:
                return  # not the receiver that joined under this index
            layout_regions = len(rec.slots[0])
        descs = None
        if msg.get("descs") is not None and slot is not None:
            try:
                sizes = [d.length for d in rec.slots[slot]]
                descs = _slot_descs(protocol.field(msg, "descs", list), address, sizes)
            except (RLError, TransferError, ValueError) as exc:
                raise RLError(f"receiver {index}: READY with unusable descriptors ({exc})") from exc
            if len(descs) != layout_regions:
                raise RLError(f"receiver {index}: READY re-keys {len(descs)} regions, not {layout_regions}")
        with self._cond:
            if self._receivers.get(index) is not rec:
                return
            rec.version = version
            if descs is not None and slot is not None:
                rec.slots[slot] = descs
            if slot is not None:
                rec.holds = _holds(msg)
            rec.free_slot = slot
            self._cond.notify_all()

    def _hello(self, address: bytes, msg: dict[str, object]) -> None:
        index = protocol.field(msg, "receiver", int)
        try:
            rec = self._join(index, address, msg)
        except (RLError, TransferError, ValueError) as exc:
            reason = f"trainer {self.index} rejects receiver {index}: {exc}"
            log.warning("%s", reason)
            try:
                protocol.send(self.channel, address, protocol.REJECT, reason=reason[:2000])
            except TransferError:
                log.debug("REJECT to receiver %d failed", index, exc_info=True)
            return
        with self._cond:
            old = self._receivers.get(index)
            taken = old is not None and old.alive and old.address != address
            if not taken:
                self._receivers[index] = rec  # a receiver that re-joins under its index replaces itself
            self._cond.notify_all()
        if taken:
            reason = f"trainer {self.index} rejects receiver {index}: another live receiver holds that index"
            log.warning("%s", reason)
            try:
                protocol.send(self.channel, address, protocol.REJECT, reason=reason)
            except TransferError:
                log.debug("REJECT to receiver %d failed", index, exc_info=True)
            return
        log.info(
            "trainer %d: receiver %d joined (%d runs, %d bytes per update, schedule %.3fs)",
            self.index,
            index,
            len(rec.runs),
            rec.bytes_per_update,
            rec.schedule_seconds,
        )

    def _join(self, index: int, address: bytes, msg: dict[str, object]) -> _ReceiverState:
        if protocol.field(msg, "digest", str) != self.digest:
            raise RLError("its model (tensor specs) differs from the trainer's")
        tp = protocol.field(msg, "tp", list)
        if len(tp) != 2 or not all(isinstance(x, int) for x in tp):
            raise RLError("field 'tp' must be [tp_size, tp_rank]")
        check_tp(tp[0], tp[1], f"receiver {index}")
        mrb = protocol.field(msg, "max_region_bytes", int)
        t0 = time.perf_counter()
        layout = shard_layout(self.specs, tp_size=tp[0], tp_rank=tp[1], max_region_bytes=mrb)
        schedule = build_receiver_schedule(
            self.specs, self._shards, RankShard(tp[0], tp[1], layout), receiver_index=index
        )
        seconds = time.perf_counter() - t0
        if list(schedule.contributors) != protocol.field(msg, "contributors", list):
            raise RLError(
                f"its schedule has contributors {msg.get('contributors')}, "
                f"the trainer computes {list(schedule.contributors)}"
            )
        slots_raw = protocol.field(msg, "slots", list)
        if len(slots_raw) != 2:
            raise RLError("field 'slots' must list two slots")
        slots = [_slot_descs(slot, address, list(layout.region_sizes)) for slot in slots_raw]
        imms = ImmRange.from_json(msg.get("imms"))
        if imms.count < protocol.IMMS:
            raise RLError(f"its immediate range holds {imms.count} values, a session needs {protocol.IMMS}")
        runs = schedule.runs_for(self.index)
        delta_desc = _delta_desc(msg.get("delta"), self.index, address) if delta_codec.aligned(runs) else None
        return _ReceiverState(
            index=index,
            address=address,
            slots=slots,
            imms=imms,
            runs=runs,
            version=protocol.field(msg, "version", int),
            free_slot=protocol.field(msg, "slot", int) & 1,
            schedule_seconds=seconds,
            bytes_per_update=sum(r.nbytes for r in runs),
            holds=_holds(msg),
            delta_desc=delta_desc,
        )

    # ----- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the session's control thread and deregister the source buffers (the engine stays open)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self.channel.close()
        for region in self._src:
            region.close()
        self._src = []
        with self._cond:
            outs = [r.delta_out for r in self._receivers.values() if r.delta_out is not None]
        for _, region in outs:
            region.close()

    def __enter__(self) -> RLTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _slot_descs(raw: object, address: bytes, sizes: list[int]) -> list[MemoryRegionDescriptor]:
    """One slot's region descriptors as a receiver sent them, checked against the layout's sizes."""
    if not isinstance(raw, list) or not all(isinstance(d, str) for d in raw):
        raise RLError("a slot is a list of base64 descriptors")
    descs = [MemoryRegionDescriptor.from_bytes(base64.b64decode(d, validate=True)) for d in raw]
    if len(descs) != len(sizes):
        raise RLError(f"a slot has {len(descs)} regions, the layout {len(sizes)}")
    for d, n in zip(descs, sizes, strict=True):
        if not d.writable or d.length < n or d.address != address:
            raise RLError("a slot region is not writable, too small, or not the receiver's")
    return descs


def _holds(msg: dict[str, object]) -> int | None:
    """The version a HELLO's or READY's free slot holds (None: unknown, or torn by an abandoned update)."""
    value = msg.get("holds")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _delta_desc(raw: object, trainer: int, address: bytes) -> MemoryRegionDescriptor | None:
    """This trainer's delta staging region from a HELLO's "delta" field ({trainer index: descriptor}), or
    None when the receiver offers none."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RLError("field 'delta' must map trainer indices to descriptors")
    entry = raw.get(str(trainer))
    if entry is None:
        return None
    if not isinstance(entry, str):
        raise RLError("a delta staging descriptor is base64 text")
    desc = MemoryRegionDescriptor.from_bytes(base64.b64decode(entry, validate=True))
    if not desc.writable or desc.address != address or desc.length < 8:
        raise RLError("the delta staging region is not writable, too small, or not the receiver's")
    return desc
