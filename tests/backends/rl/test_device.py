"""RL weight updates between device weights (backends.rl.device), real tcp engines in one process.

Resharding (trainer TP=1 to a receiver TP=2 rank), versions in order, and the device double buffer:
readers see one whole version, never a mix, and a held device slot is never written. "cpu" stands in
for the device here; "cuda" is marked gpu.
"""

from __future__ import annotations

import threading

import pytest
import torch

from backends import TransferEngine
from backends.layout import views
from backends.rl import RLError, TrainerRank, shard_layout
from backends.rl.device import DeviceRLReceiver, DeviceRLTrainer
from tests.backends.gpu.devices import DEVICES
from tests.backends.rl.test_session import SPECS


def _pair(
    engines: list[TransferEngine], device: str, *, tp_size: int = 1, tp_rank: int = 0
) -> tuple[DeviceRLTrainer, DeviceRLReceiver]:
    teng, reng = engines
    roster = [TrainerRank(teng.address, 1, 0)]
    layout = shard_layout(SPECS, tp_size=1, tp_rank=0)
    bufs = [torch.zeros(n, dtype=torch.uint8, device=device) for n in layout.region_sizes]
    trainer = DeviceRLTrainer(teng, device_buffers=bufs, session="s", specs=SPECS, trainers=roster, index=0,
                              timeout_s=10)
    receiver = DeviceRLReceiver(reng, device=device, session="s", specs=SPECS, trainers=roster, index=0,
                                tp_size=tp_size, tp_rank=tp_rank)
    trainer.wait_receivers(1, 10)
    return trainer, receiver


def _weights(trainer: DeviceRLTrainer, version: int) -> None:
    """Version v: every element of tensor i is v * 10 + i (so a mix of versions or tensors shows)."""
    for i, t in enumerate(trainer.tensors.values()):
        t.fill_(version * 10 + i)



@pytest.mark.parametrize("device", DEVICES)
def test_device_updates_reshard_and_serve_whole_versions(engines: list[TransferEngine], device: str) -> None:
    """Trainer TP=1 -> receiver rank 1 of TP=2: the receiver's device shards are slices of the trainer's."""
    trainer, receiver = _pair(engines, device, tp_size=2, tp_rank=1)
    try:
        for version in (1, 2, 3):
            _weights(trainer, version)
            for _name, t in trainer.tensors.items():  # make rows/columns distinct, so a wrong shard shows
                t.add_(torch.arange(t.numel(), device=t.device, dtype=t.dtype).view(t.shape) / 1024)
            res = trainer.update(version)
            assert res.applied == (0,)
            assert receiver.wait_version(version, 10)
            with receiver.acquire() as snap:
                assert snap.version == version
                assert snap.tensors["w"].device.type == device
                full = {n: t.cpu() for n, t in trainer.tensors.items()}
                assert torch.equal(snap.tensors["w"].cpu(), full["w"][32:])  # dim 0, rank 1 of 2
                assert torch.equal(snap.tensors["o"].cpu(), full["o"][:, 32:])  # dim 1
                assert torch.equal(snap.tensors["norm"].cpu(), full["norm"])  # replicated
        assert receiver.failure is None
    finally:
        receiver.close()
        trainer.trainer.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_held_device_slot_is_never_written_and_readers_never_see_a_mix(
    engines: list[TransferEngine], device: str
) -> None:
    trainer, receiver = _pair(engines, device)
    seen: list[int] = []
    mixed: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            with receiver.acquire() as snap:
                values = [t.clone().cpu() for t in snap.tensors.values()]  # a copy taken while pinned
                v = snap.version
            for i, t in enumerate(values):
                if not bool((t == v * 10 + i).all()):
                    mixed.append(f"version {v} tensor {i}: {t.unique().tolist()[:4]}")
            seen.append(v)

    try:
        with receiver.acquire() as old:  # a reader computing on version 0 keeps its device slot
            _weights(trainer, 1)
            assert trainer.update(1).applied == (0,)
            assert receiver.wait_version(1, 10)
            _weights(trainer, 2)
            assert trainer.update(2).applied == (0,)  # lands on the host; the device slot it needs is held
            assert not receiver.wait_version(2, 0.5)
            assert receiver.version == 1
            assert old.version == 0
            assert all(bool((t == 0).all()) for t in old.tensors.values())
        assert receiver.wait_version(2, 10)  # released: staged and served
        thread = threading.Thread(target=reader)
        thread.start()
        for version in range(3, 9):
            _weights(trainer, version)
            assert trainer.update(version).applied == (0,)
        assert receiver.wait_version(8, 10)
        stop.set()
        thread.join(10)
        assert not mixed, mixed[:3]
        assert seen == sorted(seen)
        assert seen[-1] >= 2
        assert receiver.failure is None
    finally:
        stop.set()
        receiver.close()
        trainer.trainer.close()


def test_device_buffers_are_checked(engines: list[TransferEngine]) -> None:
    roster = [TrainerRank(engines[0].address, 1, 0)]
    with pytest.raises(RLError, match="do not hold"):
        DeviceRLReceiver(engines[1], device="cpu", buffers=[torch.zeros(8, dtype=torch.uint8)], session="s",
                         specs=SPECS, trainers=roster, index=0)
    layout = shard_layout(SPECS, tp_size=1, tp_rank=0)
    host = [torch.zeros(n, dtype=torch.uint8) for n in layout.region_sizes]
    assert set(views(layout, host)) == {"w", "o", "norm"}
