"""RL session rules with real tcp engines in one process: refusals, version order, reader pinning."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from backends import Message, TransferEngine
from backends.rl import RLError, RLReceiver, RLTrainer, TensorSpec, TrainerRank, shard_layout
from backends.rl.messages import decode
from tests.backends.models import allocate
from tests.waiting import wait_until

SPECS = (
    TensorSpec("w", "float32", (64, 32), 0),
    TensorSpec("o", "float32", (32, 64), 1),
    TensorSpec("norm", "float32", (32,), None),
)


def make_trainer(eng: TransferEngine) -> RLTrainer:
    roster = [TrainerRank(eng.address, 1, 0)]
    bufs = allocate(shard_layout(SPECS, tp_size=1, tp_rank=0))
    return RLTrainer(eng, session="s", specs=SPECS, trainers=roster, index=0, buffers=bufs, timeout_s=10)


def fill(trainer: RLTrainer, value: float) -> None:
    for t in trainer.tensors.values():
        t.fill_(value)


def test_update_writes_versions_in_order_and_both_sides_see_them(engines: list[TransferEngine]) -> None:
    teng, reng = engines
    trainer = make_trainer(teng)
    receiver = RLReceiver(reng, session="s", specs=SPECS, trainers=[TrainerRank(teng.address, 1, 0)], index=7)
    try:
        trainer.wait_receivers(1, 10)
        fill(trainer, 1.5)
        res = trainer.update(1)
        assert res.applied == (7,)
        assert res.bytes_posted == sum(t.numel() * 4 for t in trainer.tensors.values())
        assert trainer.version == 1
        assert trainer.receiver_versions() == {7: 1}
        assert receiver.version == 1
        with receiver.acquire() as snap:
            assert snap.version == 1
            assert all(bool((t == 1.5).all()) for t in snap.tensors.values())
        with pytest.raises(RLError, match="not above the last one"):
            trainer.update(1)
    finally:
        receiver.close()
        trainer.close()


def test_a_pinned_old_slot_is_never_overwritten(engines: list[TransferEngine]) -> None:
    """A reader still computing on version 0 keeps its slot: version 2 (which needs it) must wait."""
    teng, reng = engines
    trainer = make_trainer(teng)
    receiver = RLReceiver(reng, session="s", specs=SPECS, trainers=[TrainerRank(teng.address, 1, 0)], index=0)
    try:
        trainer.wait_receivers(1, 10)
        with receiver.acquire() as old:
            fill(trainer, 1.0)
            assert trainer.update(1).applied == (0,)  # into the other slot: allowed
            fill(trainer, 2.0)
            t0 = time.monotonic()
            res = trainer.update(2, timeout_s=1.5)
            assert res.applied == ()
            assert "no free slot" in res.failed[0]
            assert time.monotonic() - t0 < 10
            assert old.version == 0
            assert all(bool((t == 0).all()) for t in old.tensors.values())
        fill(trainer, 3.0)
        assert trainer.update(3).applied == (0,)  # released: the slot is offered again
        with receiver.acquire() as snap:
            assert snap.version == 3
            assert all(bool((t == 3.0).all()) for t in snap.tensors.values())
    finally:
        receiver.close()
        trainer.close()


def test_a_receiver_with_another_model_is_rejected_with_a_reason(
    engines: list[TransferEngine], caplog: pytest.LogCaptureFixture
) -> None:
    teng, reng = engines
    trainer = make_trainer(teng)
    other = (*SPECS[:2], TensorSpec("norm", "float32", (33,), None))
    caplog.set_level(logging.WARNING)
    receiver = RLReceiver(reng, session="s", specs=other, trainers=[TrainerRank(teng.address, 1, 0)], index=0)
    try:
        wait_until(lambda: receiver.rejected is not None, 10, "the trainer's REJECT")
        assert receiver.rejected is not None
        assert "model (tensor specs) differs" in receiver.rejected
        with pytest.raises(RLError, match="0 of 1 receivers joined"):
            trainer.wait_receivers(1, 0.5)
    finally:
        receiver.close()
        trainer.close()


def test_receiver_buffers_must_hold_the_layout(engines: list[TransferEngine]) -> None:
    teng, reng = engines
    with pytest.raises(RLError, match="do not hold the layout's regions"):
        RLReceiver(
            reng,
            session="s",
            specs=SPECS,
            trainers=[TrainerRank(teng.address, 1, 0)],
            index=0,
            buffers=[torch.zeros(16, dtype=torch.uint8)],
        )


def test_messages_of_other_sessions_are_ignored_and_garbage_is_an_error(
    engines: list[TransferEngine],
) -> None:
    sender = engines[0].address
    assert decode(Message("rl/a", "ready", sender, b'{"version":1}')) == {"kind": "ready", "version": 1}
    with pytest.raises(RLError, match="malformed"):
        decode(Message("rl/a", "ready", sender, b"\xff not json"))
    with pytest.raises(RLError, match="malformed"):
        decode(Message("rl/a", "launch", sender, b"{}"))
    # A receiver of another session talks on another channel: this session's trainer never hears it.
    teng, reng = engines
    trainer = make_trainer(teng)
    roster = [TrainerRank(teng.address, 1, 0)]
    other = RLReceiver(reng, session="other", specs=SPECS, trainers=roster, index=0)
    try:
        with pytest.raises(RLError, match="0 of 1 receivers joined"):
            trainer.wait_receivers(1, 0.5)
    finally:
        other.close()
        trainer.close()
