"""RL sessions against hostile or flaky peers (real tcp engines; the forger is another process):
a peer outside the roster cannot begin versions or replace a receiver, a trainer's version jump is
bounded, a transient write error is retried, a dropped receiver is told, and a slow trainer's late
writes cannot land in a slot the receiver moved past (the slot is re-keyed)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future

import pytest

from backends import TransferEngine, TransferError
from backends.rl import RLError, RLReceiver, RLTrainer, TrainerRank, shard_layout
from backends.rl import messages as protocol
from tests.backends.conftest import Peer, start_peer
from tests.backends.models import allocate
from tests.backends.rl.test_session import SPECS, fill, make_trainer
from tests.waiting import wait_until


@pytest.fixture
def forger() -> Iterator[Peer]:
    p = start_peer("tcp", [("small", 4096, "rw")], domains=1)
    yield p
    p.stop()


def _all(receiver: RLReceiver, value: float) -> bool:
    with receiver.acquire() as snap:
        return all(bool((t == value).all()) for t in snap.tensors.values())


@pytest.mark.timeout(60)
def test_a_peer_outside_the_roster_cannot_begin_a_version_or_steal_a_receiver(
    engines: list[TransferEngine], forger: Peer
) -> None:
    """Failed before: a BEGIN with version 2**60 from anyone was taken, abandoned after
    update_timeout_s, and every real version after it was ignored for ever."""
    teng, reng = engines
    trainer = make_trainer(teng)
    roster = [TrainerRank(teng.address, 1, 0)]
    receiver = RLReceiver(reng, session="s", specs=SPECS, trainers=roster, index=0, update_timeout_s=1.0)
    try:
        trainer.wait_receivers(1, 10)
        begin = json.dumps({"version": 2**60}).encode()
        assert forger.call("send", reng.address, "rl/s", "begin", begin) is True
        # and a HELLO for receiver 0 from the forger's own address (it cannot claim another's)
        hello = json.dumps({"receiver": 0, "version": 0, "slot": 1}).encode()
        assert forger.call("send", teng.address, "rl/s", "hello", hello) is True
        # both were handled: the trainer answered the HELLO (REJECT), the receiver dropped the BEGIN
        # (taken, it would hold the receiver's next update until update_timeout_s, then ignore version 1)
        assert [kind for kind, _, _ in forger.call("inbox", "rl/s", 1, 10)] == [protocol.REJECT]
        wait_until(lambda: receiver.foreign >= 1, 10, "the receiver drops the forged BEGIN")
        fill(trainer, 2.0)
        res = trainer.update(1, timeout_s=10)
        assert res.applied == (0,), res
        assert receiver.version == 1
        assert _all(receiver, 2.0)
        assert receiver.foreign >= 1
        # a roster trainer's jump is bounded too
        protocol.send(trainer.channel, reng.address, protocol.BEGIN, version=2**60).result(5)
        wait_until(lambda: receiver.refused >= 1, 10, "the receiver refuses the jump past MAX_VERSION_JUMP")
        fill(trainer, 3.0)
        assert trainer.update(2, timeout_s=10).applied == (0,)
        assert _all(receiver, 3.0)
    finally:
        receiver.close()
        trainer.close()


@pytest.mark.timeout(60)
def test_a_transient_error_is_retried_and_a_dropped_receiver_is_told(engines: list[TransferEngine]) -> None:
    teng, reng = engines
    trainer = make_trainer(teng)
    roster = [TrainerRank(teng.address, 1, 0)]
    receiver = RLReceiver(reng, session="s", specs=SPECS, trainers=roster, index=0)
    real_write = teng.write
    failures = [1]

    def flaky_write(*args: object, **kwargs: object) -> object:
        if failures[0] > 0:
            failures[0] -= 1
            raise TransferError("injected transient failure")
        return real_write(*args, **kwargs)  # type: ignore[arg-type]

    try:
        trainer.wait_receivers(1, 10)
        teng.write = flaky_write  # type: ignore[method-assign, assignment]
        teng.write_paged = flaky_write  # type: ignore[method-assign, assignment]
        fill(trainer, 4.0)
        assert trainer.update(1, timeout_s=10).applied == (0,)
        assert _all(receiver, 4.0)
        failures[0] = 1000  # now it keeps failing: dropped after the retries, and told so
        fill(trainer, 5.0)
        res = trainer.update(2, timeout_s=10)
        assert 0 in res.dropped
        wait_until(lambda: 0 in receiver.dropped_by, 5, "the receiver told it was dropped")
        assert "injected" in receiver.dropped_by[0]
    finally:
        del teng.write
        del teng.write_paged
        receiver.close()
        trainer.close()


@pytest.mark.timeout(60)
def test_a_slow_trainers_late_writes_cannot_land_in_a_slot_the_receiver_moved_past(
    engines: list[TransferEngine],
) -> None:
    teng, reng = engines
    trainer = make_trainer(teng)
    roster = [TrainerRank(teng.address, 1, 0)]
    receiver = RLReceiver(reng, session="s", specs=SPECS, trainers=roster, index=0, update_timeout_s=1.0)
    def held_back(*_a: object, **_k: object) -> Future[None]:
        """The completion immediate, held back (the trainer is slow): reported sent, never sent."""
        f: Future[None] = Future()
        f.set_result(None)
        return f

    try:
        trainer.wait_receivers(1, 10)
        rec = trainer._receivers[0]
        free = rec.free_slot
        assert free is not None
        old = list(rec.slots[free])
        # version 1's writes land but its completion is late: the receiver abandons it
        teng.write_imm = held_back  # type: ignore[method-assign]
        fill(trainer, 6.0)
        res = trainer.update(1, timeout_s=10)
        assert "abandoned" in res.failed[0]
        assert receiver.version == 0
        assert rec.slots[free] != old  # READY brought the re-keyed slot
        # the slow trainer's write for version 1, still using the old keys, cannot land
        with pytest.raises(TransferError):
            teng.write(trainer._src[0], 0, 64, old[0], 0).result(10)
        del teng.write_imm
        fill(trainer, 7.0)
        assert trainer.update(2, timeout_s=10).applied == (0,)
        assert _all(receiver, 7.0)
    finally:
        teng.__dict__.pop("write_imm", None)
        receiver.close()
        trainer.close()


@pytest.mark.timeout(60)
def test_a_session_key_keeps_out_a_receiver_without_it(engines: list[TransferEngine]) -> None:
    teng, reng = engines
    roster = [TrainerRank(teng.address, 1, 0)]
    bufs = allocate(shard_layout(SPECS, tp_size=1, tp_rank=0))
    key = b"session-secret-from-the-planner!"
    trainer = RLTrainer(teng, session="s", specs=SPECS, trainers=roster, index=0, buffers=bufs,
                        timeout_s=10, channel_key=key)
    outsider = RLReceiver(reng, session="s", specs=SPECS, trainers=roster, index=0, channel_key=b"w" * 32)
    try:
        with pytest.raises(RLError, match="0 of 1 receivers joined"):
            trainer.wait_receivers(1, 1.0)
        assert teng.frames_dropped["forged"] >= 1
    finally:
        outsider.close()
    member = RLReceiver(reng, session="s", specs=SPECS, trainers=roster, index=0, channel_key=key)
    try:
        trainer.wait_receivers(1, 10)
        fill(trainer, 8.0)
        assert trainer.update(1, timeout_s=10).applied == (0,)
        assert _all(member, 8.0)
    finally:
        member.close()
        trainer.close()
