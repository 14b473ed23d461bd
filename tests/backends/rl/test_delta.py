"""Weight deltas: the codec (any TP pair, any change pattern) and a session that sends only changed words."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends import TransferEngine
from backends.rl import RLError, RLReceiver, RLTrainer, TensorSpec, TrainerRank, shard_layout
from backends.rl import delta as codec
from backends.rl.schedule import RankShard, build_receiver_schedule
from tests.backends.models import allocate
from tests.waiting import wait_until

SPECS = (
    TensorSpec("w", "bfloat16", (64, 48), 0),
    TensorSpec("o", "bfloat16", (48, 64), 1),
    TensorSpec("norm", "float32", (48,), None),
)


def _shards(tp: int) -> list[RankShard]:
    return [RankShard(tp, r, shard_layout(SPECS, tp_size=tp, tp_rank=r)) for r in range(tp)]


def _random_buffers(layout_sizes: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in layout_sizes]


@settings(max_examples=60, deadline=None)
@given(
    trainer_tp=st.sampled_from([1, 2, 4]),
    receiver_tp=st.sampled_from([1, 2, 4]),
    receiver_rank=st.integers(0, 3),
    fraction=st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_a_delta_turns_the_old_receiver_bytes_into_the_new_for_any_tp_pair(
    trainer_tp: int, receiver_tp: int, receiver_rank: int, fraction: float, seed: int
) -> None:
    receiver_rank %= receiver_tp
    trainers = _shards(trainer_tp)
    layout = shard_layout(SPECS, tp_size=receiver_tp, tp_rank=receiver_rank)
    me = RankShard(receiver_tp, receiver_rank, layout)
    schedule = build_receiver_schedule(SPECS, trainers, me, receiver_index=0)
    g = torch.Generator().manual_seed(seed)
    old = {t: _random_buffers(s.layout.region_sizes, seed + t) for t, s in enumerate(trainers)}
    new = {}
    for t, bufs in old.items():
        changed = []
        for b in bufs:
            c = b.clone()
            mask = torch.rand(c.numel(), generator=g) < fraction
            c[mask] = torch.randint(0, 256, (int(mask.sum()),), generator=g, dtype=torch.uint8)
            changed.append(c)
        new[t] = changed

    def fill(src: dict[int, list[torch.Tensor]]) -> list[torch.Tensor]:
        dst = [torch.zeros(n, dtype=torch.uint8) for n in me.layout.region_sizes]
        for r in schedule.runs:
            for k in range(r.count):
                s0, d0 = r.src_offset + k * r.src_stride, r.dst_offset + k * r.dst_stride
                dst[r.dst_region][d0 : d0 + r.length] = src[r.trainer][r.src_region][s0 : s0 + r.length]
        return dst

    receiver = fill(old)
    for t in schedule.contributors:
        runs = schedule.runs_for(t)
        assert codec.aligned(runs)
        words = codec.changed_words(old[t], new[t])
        assert words is not None
        out = torch.empty(codec.delta_capacity_bytes(runs, sum(w.numel() for w in words)), dtype=torch.uint8)
        nbytes = codec.encode(runs, words, new[t], out)
        assert nbytes is not None
        codec.apply(runs, out[:nbytes], receiver)
        assert codec.runs_digest(runs, receiver, source=False) == codec.runs_digest(runs, new[t], source=True)
    assert all(torch.equal(a, b) for a, b in zip(receiver, fill(new), strict=True))


def test_a_delta_that_does_not_fit_is_not_encoded_and_a_torn_one_is_refused() -> None:
    trainers = _shards(1)
    schedule = build_receiver_schedule(SPECS, trainers, _shards(1)[0], receiver_index=0)
    runs = schedule.runs_for(0)
    old = _random_buffers(trainers[0].layout.region_sizes, 1)
    new = [b.clone() for b in old]
    new[0][:400] += 1
    words = codec.changed_words(old, new)
    assert words is not None
    assert codec.changed_words(old, new, limit=99) is None  # stops counting past what a delta could carry
    assert codec.changed_words(old, new, limit=100) is not None
    assert codec.encode(runs, words, new, torch.empty(64, dtype=torch.uint8)) is None
    out = torch.empty(1 << 16, dtype=torch.uint8)
    nbytes = codec.encode(runs, words, new, out)
    assert nbytes == codec.delta_capacity_bytes(runs, 100)
    dst = [b.clone() for b in old]
    with pytest.raises(RLError, match="does not hold"):
        codec.apply(runs, out[: nbytes - 4], dst)
    bad = out[:nbytes].clone()
    head = 8 * len(runs)
    bad[head : head + 4].view(torch.int32)[0] = 1 << 30  # a position past the run
    with pytest.raises(RLError, match="outside run"):
        codec.apply(runs, bad, dst)
    assert all(torch.equal(a, b) for a, b in zip(dst, old, strict=True))  # nothing written


def _step(trainer: RLTrainer, version: int, fraction: float) -> None:
    """Change about `fraction` of the trainer's values (an optimizer step at a small learning rate)."""
    g = torch.Generator().manual_seed(version)
    for t in trainer.tensors.values():
        flat = t.view(-1)
        mask = torch.rand(flat.numel(), generator=g) < fraction
        flat[mask] = torch.randn(int(mask.sum()), generator=g).to(flat.dtype)


def _delta_pair(
    teng: TransferEngine, reng: TransferEngine, session: str, update_timeout_s: float = 60.0
) -> tuple[RLTrainer, RLReceiver]:
    """A TP=1 trainer with deltas and a receiver with a staging area of half its bytes."""
    roster = [TrainerRank(teng.address, 1, 0)]
    bufs = allocate(shard_layout(SPECS, tp_size=1, tp_rank=0))
    trainer = RLTrainer(
        teng, session=session, specs=SPECS, trainers=roster, index=0, buffers=bufs, timeout_s=10, deltas=True
    )
    receiver = RLReceiver(
        reng, session=session, specs=SPECS, trainers=roster, index=0, delta_fraction=0.5,
        update_timeout_s=update_timeout_s,
    )
    return trainer, receiver


def _holds_trainers_bytes(receiver: RLReceiver, trainer: RLTrainer) -> bool:
    with receiver.acquire() as snap:
        return all(torch.equal(snap.tensors[n], trainer.tensors[n]) for n in trainer.tensors)


def test_updates_after_the_first_two_send_only_changed_words_and_match_the_trainer(
    engines: list[TransferEngine],
) -> None:
    teng, reng = engines
    trainer, receiver = _delta_pair(teng, reng, "d")
    try:
        trainer.wait_receivers(1, 10)
        full = sum(t.numel() * t.element_size() for t in trainer.tensors.values())
        for version in range(1, 7):
            _step(trainer, version, 1.0 if version == 1 else 0.01)
            res = trainer.update(version)
            assert res.applied == (0,), res
            # versions 1 and 2 land in slots whose bytes the trainer never sent: whole runs
            assert res.as_delta == ((0,) if version >= 3 else ()), (version, res)
            if version >= 3:
                assert res.bytes_posted < full * 0.1
            assert _holds_trainers_bytes(receiver, trainer), version
        assert receiver.applied_as_delta == 4
        # a step that changes most values is sent whole (its delta would not fit the staging area)
        _step(trainer, 7, 0.9)
        res = trainer.update(7)
        assert res.as_delta == ()
        assert res.applied == (0,)
        assert _holds_trainers_bytes(receiver, trainer)
    finally:
        receiver.close()
        trainer.close()


def test_a_delta_from_the_wrong_base_is_caught_by_the_digest_and_never_served(
    engines: list[TransferEngine], caplog: pytest.LogCaptureFixture
) -> None:
    """The receiver's free slot is changed behind the trainer's back: the delta lands on other bytes, the
    digest check refuses the version, the receiver stays on the old one, and the next update is whole."""
    teng, reng = engines
    trainer, receiver = _delta_pair(teng, reng, "d")
    caplog.set_level(logging.WARNING)
    try:
        trainer.wait_receivers(1, 10)
        for version in (1, 2):
            _step(trainer, version, 1.0 if version == 1 else 0.01)
            assert trainer.update(version).applied == (0,)
        free = 1 - receiver._active
        receiver._slots[free][0][:64] ^= 0xFF  # a fault in the free slot (it holds version 1)
        _step(trainer, 3, 0.01)
        res = trainer.update(3, timeout_s=5)
        assert res.as_delta == (0,)
        assert res.applied == ()
        assert "abandoned version 3" in res.failed[0]
        assert receiver.version == 2
        assert receiver.abandoned == 1
        assert "digest" in caplog.text
        _step(trainer, 4, 0.01)
        res = trainer.update(4)
        assert res.applied == (0,)
        assert res.as_delta == ()  # the torn slot gets whole runs
        assert _holds_trainers_bytes(receiver, trainer)
    finally:
        receiver.close()
        trainer.close()


@pytest.fixture(scope="module")
def delta_session() -> Iterator[tuple[RLTrainer, RLReceiver]]:
    made = [TransferEngine("tcp", 1, timeout_s=3.0, host="127.0.0.1") for _ in range(2)]
    trainer, receiver = _delta_pair(made[0], made[1], "h", update_timeout_s=2)
    trainer.wait_receivers(1, 10)
    yield trainer, receiver
    receiver.close()
    trainer.close()
    for e in made:
        e.close()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    payload=st.binary(min_size=0, max_size=256),
    claimed=st.one_of(st.integers(-8, 300), st.just(1 << 40)),
    base=st.one_of(st.none(), st.integers(-2, 50)),
)
def test_a_roster_trainers_hostile_delta_is_never_served(
    delta_session: tuple[RLTrainer, RLReceiver], payload: bytes, claimed: int, base: int | None
) -> None:
    """BEGIN with a delta of any size, base and bytes, the payload written into the staging area and the
    completion immediate sent, as a trainer would: the receiver abandons the version with an error, its
    control thread lives, and the honest trainer's next update applies and matches."""
    trainer, receiver = delta_session
    rec = trainer._receivers[0]
    assert rec.delta_desc is not None
    with receiver._cond:
        top = max(receiver._version, receiver._abandoned_up_to) + 1
    version = top
    keys = [list(slot) for slot in rec.slots]
    if payload:
        src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        region = trainer.engine.register(src, "read")
        try:
            trainer.engine.write(region, 0, len(payload), rec.delta_desc, 0).result(5)
        finally:
            region.close()
    fields = {"base": base, "bytes": claimed, "digest": "0" * 32}
    trainer.channel.send_json(receiver.engine.address, "begin", version=version, delta=fields).result(5)
    def begun() -> bool:  # the BEGIN is taken (or already abandoned) before the completion immediate
        pending = receiver._pending
        return (pending is not None and pending.version == version) or receiver._abandoned_up_to >= version

    wait_until(begun, 5, "the hostile BEGIN taken")
    trainer.engine.write_imm(rec.imms.value(version), rec.slots[0][0]).result(5)
    wait_until(lambda: receiver._pending is None, 5, "the hostile update settled")
    assert receiver.version < version
    assert receiver._thread.is_alive()
    # the abandoned slot's new keys reach the trainer (READY) before it goes on
    wait_until(lambda: [list(slot) for slot in rec.slots] != keys, 5, "the re-keyed slot's READY")
    with trainer._cond:
        trainer._version = version  # test-only: the honest trainer goes on past the hostile version
    _step(trainer, version + 1, 1.0)
    res = trainer.update(version + 1, timeout_s=10)
    assert res.applied == (0,), res
    assert _holds_trainers_bytes(receiver, trainer)
