"""RL weight updates between weights in GPU memory, staged through pinned host memory.

The session's protocol (HELLO/READY/BEGIN, the static schedule with its resharding, one-sided writes
into the receiver's free slot, one completion immediate per trainer counted by the ImmCounter) is
`backends.rl`'s, unchanged, over pinned host buffers. Around it:

- `DeviceRLTrainer.update(v)`: copy the device weights into the trainer's pinned host regions
  (finished), then `RLTrainer.update(v)`.
- `DeviceRLReceiver`: the host receiver flips its two host slots as before. A staging thread sees
  each new host version, pins that host slot (`acquire`, so no update can rewrite it meanwhile),
  copies it into the *free* one of two device slots once the device readers of that slot have
  left, and then flips the device slots under a lock. Readers `acquire()` the active device slot:
  they get one whole version or the other, never a mix, and a slot is never written while a reader
  holds it.

A CPU `device` runs the same code (the tests and the CPU rehearsal).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from backends.engine import TransferEngine
from backends.gpu.host_copy import device_of, pinned_empty, synchronize
from backends.gpu.staging import byte_view
from backends.layout import views
from backends.rl.receiver import RLReceiver, SlotReaders, Snapshot
from backends.rl.spec import DEFAULT_MAX_REGION_BYTES, RLError, shard_layout
from backends.rl.trainer import RLTrainer, UpdateResult

log = logging.getLogger(__name__)

__all__ = ["DeviceRLReceiver", "DeviceRLTrainer"]

_POLL_S = 0.2  # the staging thread's wait for a new host version (a condition wait, not a spin)


def _device_regions(buffers: Sequence[torch.Tensor], sizes: Sequence[int], who: str) -> list[torch.Tensor]:
    if len(buffers) != len(sizes):
        raise RLError(f"{who}: {len(buffers)} device buffers for {len(sizes)} regions")
    out = [byte_view(b) for b in buffers]
    got = [int(b.numel()) for b in out]
    if any(g < n for g, n in zip(got, sizes, strict=True)):
        raise RLError(f"{who}: device buffers of {got} bytes do not hold the layout's regions {list(sizes)}")
    return out


class DeviceRLTrainer:
    """A trainer rank whose weights live in `device_buffers` (one flat region each, the layout's).

    The training loop writes new weights into `tensors` (views of the device buffers) between
    updates. Other keyword arguments are RLTrainer's (session, specs, trainers, index, ...).
    """

    def __init__(self, engine: TransferEngine, *, device_buffers: Sequence[torch.Tensor],
                 **kwargs: Any) -> None:  # noqa: ANN401 - RLTrainer's keyword arguments
        self.device_buffers = [byte_view(b) for b in device_buffers]
        host = [pinned_empty(b.numel()) for b in self.device_buffers]
        self.trainer = RLTrainer(engine, buffers=host, **kwargs)  # checks the sizes against its layout
        self.layout = self.trainer.layout
        self.tensors = views(self.layout, self.device_buffers)

    def stage(self) -> None:
        """Copy the device weights into the registered host regions; finished on return."""
        for dev, host in zip(self.device_buffers, self.trainer.buffers, strict=True):
            host.copy_(dev, non_blocking=True)
        synchronize(*self.device_buffers)

    def update(self, version: int, **kwargs: Any) -> UpdateResult:  # noqa: ANN401 - RLTrainer.update's
        """Stage the device weights, then write this rank's share of `version` (see RLTrainer.update)."""
        self.stage()
        return self.trainer.update(version, **kwargs)

    def wait_receivers(self, count: int, timeout_s: float) -> None:
        """Block until `count` receivers have joined."""
        self.trainer.wait_receivers(count, timeout_s)

    @property
    def schedule_seconds(self) -> float:
        """Time spent computing schedules."""
        return self.trainer.schedule_seconds

    @property
    def version(self) -> int:
        """The last version this trainer posted."""
        return self.trainer.version

    def close(self) -> None:
        """Close the host trainer (the engine stays)."""
        self.trainer.close()


class DeviceRLReceiver(SlotReaders):
    """An inference rank whose served weights live in two device slots (see the module docstring).

    `buffers`: the rank's device parameter regions (slot 0; slot 1 is allocated beside them), or None
    for zeroed ones on `device`. Other keyword arguments are RLReceiver's (session, specs, trainers,
    index, tp_size, tp_rank, ...).
    """

    def __init__(self, engine: TransferEngine, *, device: torch.device | str | None = None,
                 buffers: Sequence[torch.Tensor] | None = None,
                 **kwargs: Any) -> None:  # noqa: ANN401 - RLReceiver's keyword arguments
        self.device = device_of(device)
        self._cond = threading.Condition()
        self._closed = False
        self._active = 0
        self._readers = [0, 0]
        self.failure: str | None = None
        version = int(kwargs.get("version", 0))
        self._version = version
        # The host receiver says hello on construction: the device slots must exist before any update.
        layout = shard_layout(tuple(kwargs["specs"]), tp_size=int(kwargs.get("tp_size", 1)),
                              tp_rank=int(kwargs.get("tp_rank", 0)),
                              max_region_bytes=int(kwargs.get("max_region_bytes", DEFAULT_MAX_REGION_BYTES)))
        sizes = layout.region_sizes
        who = f"receiver {kwargs.get('index')}"
        if buffers is None:
            slot0 = [torch.zeros(n, dtype=torch.uint8, device=self.device) for n in sizes]
        else:
            slot0 = _device_regions(buffers, sizes, who)
            if any(b.device != self.device for b in slot0):
                raise RLError(f"{who}: device buffers are not on {self.device}")
        self._slots = (slot0, [b.clone() for b in slot0])
        self._views = tuple(views(layout, s) for s in self._slots)
        host0 = [pinned_empty(n) for n in sizes]
        for h, d in zip(host0, slot0, strict=True):
            h.copy_(d[: h.numel()])  # the host slots start as the device weights (version `version`)
        self.receiver = RLReceiver(engine, buffers=host0, **kwargs)
        self.layout = self.receiver.layout
        self.index = self.receiver.index
        self.applied = 0
        self.applied_at = 0.0  # time.time() when the device last flipped to a new version
        self._thread = threading.Thread(target=self._stage_loop, name=f"rl-device-receiver-{self.index}",
                                        daemon=True)
        self._thread.start()

    # ----- reader side --------------------------------------------------------------------------
    def wait_version(self, version: int, timeout_s: float) -> bool:
        """Block until device readers get `version` or later; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._version >= version or self._closed, timeout_s) and \
                self._version >= version

    # ----- staging ------------------------------------------------------------------------------
    def _stage_loop(self) -> None:
        try:
            while not self._closed:
                if not self.receiver.wait_version(self._version + 1, _POLL_S):
                    continue
                with self.receiver.acquire() as snap:
                    self._stage(snap)
        except Exception as exc:  # noqa: BLE001 - kept for the owner; readers stay on the last good version
            self.failure = f"{type(exc).__name__}: {exc}"
            log.exception("receiver %d: staging to %s failed; serving version %d", self.index, self.device,
                          self._version)

    def _stage(self, snap: Snapshot) -> None:
        with self._cond:
            free = 1 - self._active
            self._cond.wait_for(lambda: self._readers[free] == 0 or self._closed)
            if self._closed:
                return
        dst = self._views[free]
        for name, src in snap.tensors.items():
            if src.numel():
                dst[name].copy_(src, non_blocking=True)
        synchronize(*self._slots[free])
        with self._cond:
            self._active = free
            self._version = snap.version
            self.applied += 1
            self.applied_at = time.time()
            self._cond.notify_all()
        log.debug("receiver %d: device now on version %d", self.index, snap.version)

    def close(self) -> None:
        """Stop staging and close the host receiver (the engine stays)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self.receiver.close()
