"""No late write after a failed attempt (issue #23, item 4).

Seed A stalls (SIGSTOP) in the middle of a pull with reads still posted to it; the loader gives up on
it, pulls the same tensors from seed B, verifies them and becomes a seed itself (its engine keeps
running). Then A wakes up (SIGCONT). Whatever A sends
for the old reads must not land in the verified tensors. A serves bytes that differ from its manifest
(tests/rfork/pull/changed_seed.py: an in-place update or a memory fault, seen from outside), so a late
write would show as a difference from the checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

import pytest
import torch

from bench.processes import available_providers
from rfork import Loader, LoadOptions
from rfork.weights.checkpoint import load_state_dict, read_checkpoint_info
from tests.backends.processes import stop_process
from tests.rfork.conftest import LOAD, REGISTER, assert_same, start_seed
from tests.waiting import holds_for

pytestmark = pytest.mark.slow


def _stalling_loader(provider: str, stall: Any, **kw: Any) -> Loader:
    """A loader that calls `stall(instance_id)` once, when the first bytes of its first pull arrived."""
    state: dict[str, Any] = {"current": None, "fired": None}

    class Stalling(Loader):
        def _pull(self, source: Any, *args: Any, **kwargs: Any) -> Any:
            state["current"] = source.instance_id
            return super()._pull(source, *args, **kwargs)

    def on_progress(done: int, total: int) -> None:
        if state["fired"] is None and 0 < done < total and state["current"] is not None:
            state["fired"] = state["current"]
            stall(state["current"])

    loader = Stalling(
        progress=on_progress,
        token=LOAD,
        register_token=REGISTER,
        options=LoadOptions(
            providers=[provider],
            transfer_timeout_s=2.0,
            rank_deadline_s=60.0,
            chunk_bytes=1 << 20,
            max_inflight=4,
        ),
        **kw,
    )
    loader.stall_state = state  # type: ignore[attr-defined]
    return loader


def _unchanged_for_a_while(dest: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """A negative window: nothing marks the end of A's late answers (it is another process, woken up
    with its old reads still posted), so the weights are watched for 2 s, the time a woken seed takes
    to send what it held many times over; a late write fails the test when it lands."""
    holds_for(lambda: all(torch.equal(dest[k], expected[k]) for k in expected), 2.0,
              "the verified weights stay as read after the stalled seed wakes up", every_s=0.2)
    assert_same(dest, expected)


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_a_stalled_seed_cannot_write_into_weights_verified_elsewhere(fleet, medium_ckpt, planner, provider):
    if not available_providers([provider])[0]:
        pytest.skip(f"{provider} is not available here")
    ready = fleet.workdir / "changed.ready.json"
    a = fleet.spawn(
        "seed-a-changed",
        [str(medium_ckpt), planner, str(ready), provider],
        module="tests.rfork.pull.changed_seed",
    )
    a_ids = fleet.wait_file(a, ready, timeout_s=90)["instance_ids"]
    # seed B is a healthy seed on another node: the planner offers A (same node as the loader) first
    b_ids, _ = start_seed(
        fleet, medium_ckpt, planner, name="seed-b", providers=[provider], env={"RFORK_NODE": "elsewhere"}
    )
    info = read_checkpoint_info(medium_ckpt)
    expected = load_state_dict(medium_ckpt)
    dest = {name: torch.zeros_like(t) for name, t in expected.items()}

    loader = _stalling_loader(
        provider,
        lambda iid: stop_process(a.proc.pid or 0) if iid == a_ids[0] else None,
        identity=info.identity(),
        planner_url=planner,
    )
    try:
        result = loader.pull_into(dest)
        assert loader.stall_state["fired"] == a_ids[0]  # type: ignore[attr-defined]
        assert result.seed is not None  # it serves what it verified: its engine lives on
        assert result.verified
        assert [x.instance_id for x in result.attempts if x.ok] == b_ids
        assert_same(dest, expected)
        os.kill(a.proc.pid, signal.SIGCONT)  # A wakes up and answers the old reads
        _unchanged_for_a_while(dest, expected)
        result.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(a.proc.pid, signal.SIGCONT)


def test_a_stalled_seed_cannot_write_into_weights_read_from_disk_after_it(fleet, medium_ckpt, planner):
    """The same with no other seed: the loader falls back to the checkpoint on disk."""
    ready = fleet.workdir / "changed.ready.json"
    a = fleet.spawn(
        "seed-a-changed",
        [str(medium_ckpt), planner, str(ready), "tcp"],
        module="tests.rfork.pull.changed_seed",
    )
    a_ids = fleet.wait_file(a, ready, timeout_s=90)["instance_ids"]
    info = read_checkpoint_info(medium_ckpt)
    expected = load_state_dict(medium_ckpt)
    dest = {name: torch.zeros_like(t) for name, t in expected.items()}
    loader = _stalling_loader(
        "tcp",
        lambda _iid: stop_process(a.proc.pid or 0),
        identity=info.identity(),
        planner_url=planner,
        checkpoint=info,
    )
    try:
        result = loader.pull_into(dest)
        assert loader.stall_state["fired"] == a_ids[0]  # type: ignore[attr-defined]
        assert result.source == "disk"
        assert_same(dest, expected)
        os.kill(a.proc.pid, signal.SIGCONT)
        _unchanged_for_a_while(dest, expected)
        result.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(a.proc.pid, signal.SIGCONT)
