"""RL weight updates across real processes: 2 trainer processes, 3 receiver processes, tcp engines.

Every receiver runs a reader thread that computes on snapshots throughout and checks each one is a
whole version (all tensors equal to that version's bytes); it must never see a mix.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from backends.rl import TrainerRank
from tests.backends.processes import stop_process
from tests.backends.rl import peers as rl_peers
from tests.backends.rl.peers import Proc

pytestmark = pytest.mark.slow


class Session:
    def __init__(
        self,
        trainers: Sequence[tuple[int, int]],
        receivers: Sequence[tuple[int, int]],
        *,
        die_at: dict[int, int] | None = None,
        receiver_timeout_s: float = 30.0,
    ) -> None:
        self.trainers: list[Proc] = []
        self.receivers: list[Proc] = []
        die_at = die_at or {}
        try:
            for i, (tp, rank) in enumerate(trainers):
                self.trainers.append(rl_peers.start(rl_peers.trainer_main, i, tp, rank)[0])
            addresses = [rl_peers.recv(t.conn, f"trainer {i}") for i, t in enumerate(self.trainers)]
            roster = [TrainerRank(a, tp, rank) for a, (tp, rank) in zip(addresses, trainers, strict=True)]
            for t in self.trainers:
                t.conn.send(roster)
            for i, t in enumerate(self.trainers):
                assert rl_peers.recv(t.conn, f"trainer {i} session") == "ready"
            for j, (tp, rank) in enumerate(receivers):
                args = (j, tp, rank, roster, die_at.get(j), receiver_timeout_s)
                self.receivers.append(rl_peers.start(rl_peers.receiver_main, *args)[0])
            for j, r in enumerate(self.receivers):
                assert rl_peers.recv(r.conn, f"receiver {j}") == "ready"
            for t in self.trainers:
                assert t.call("wait_receivers", len(receivers), 60.0, timeout=90)
        except BaseException:
            self.close()
            raise

    def update(
        self, version: int, timeout_s: float = 30.0, trainers: Sequence[int] | None = None
    ) -> list[Any]:
        chosen = [self.trainers[i] for i in (trainers if trainers is not None else range(len(self.trainers)))]
        for t in chosen:
            t.conn.send(("update", version, timeout_s))
        out = []
        for t in chosen:
            assert t.conn.poll(timeout_s + 30), "trainer did not finish its update"
            out.append(t.conn.recv())
        return out

    def verify(self, receiver: int, version: int) -> None:
        got, bad = self.receivers[receiver].call("verify")
        assert got == version, f"receiver {receiver} serves version {got}, expected {version}"
        assert bad == [], f"receiver {receiver}: tensors differ from version {version}: {bad[:3]}"

    def close(self) -> None:
        procs = [*self.receivers, *self.trainers]
        for p in procs:  # ask all first, then wait: they shut down in parallel
            p.ask_exit()
        for p in procs:
            p.stop()


@pytest.fixture
def sessions() -> Iterator[list[Session]]:
    made: list[Session] = []
    yield made
    for s in made:
        s.close()


@pytest.mark.parametrize(
    ("trainers", "receivers"),
    [
        pytest.param([(2, 0), (2, 1)], [(1, 0), (1, 0), (1, 0)], id="trainer-tp2-to-tp1"),
        pytest.param([(1, 0), (1, 0)], [(2, 0), (2, 1), (1, 0)], id="trainer-tp1-to-tp2"),
    ],
)
def test_three_random_updates_arrive_byte_for_byte_and_readers_never_see_a_mix(
    sessions: list[Session], trainers: list[tuple[int, int]], receivers: list[tuple[int, int]]
) -> None:
    s = Session(trainers, receivers)
    sessions.append(s)
    for j in range(len(receivers)):
        s.verify(j, 0)
    for version in (1, 2, 3):
        results = s.update(version)
        for res in results:
            assert res["applied"] == [0, 1, 2]
            assert res["dropped"] == res["failed"] == []
            assert res["trainer_version"] == version
            assert res["receiver_versions"] == {0: version, 1: version, 2: version}
        for j in range(len(receivers)):
            s.verify(j, version)
    for j in range(len(receivers)):
        stats = s.receivers[j].call("stats")
        assert stats["mixed"] == 0, stats
        assert stats["applied"] == 3
        assert stats["reads"] > 10
        assert len(stats["versions"]) >= 2, stats  # the reader kept computing across updates


def test_a_receiver_killed_mid_update_is_dropped_and_the_others_finish(sessions: list[Session]) -> None:
    s = Session([(2, 0), (2, 1)], [(1, 0), (1, 0), (1, 0)], die_at={1: 2})
    sessions.append(s)
    for res in s.update(1):
        assert res["applied"] == [0, 1, 2]
    t0 = time.monotonic()
    results = s.update(2)  # receiver 1 SIGKILLs itself on BEGIN, with the writes in flight
    took = time.monotonic() - t0
    for res in results:
        assert res["applied"] == [0, 2]
        assert res["dropped"] == [1]
    assert took < 30, f"dropping a dead receiver took {took:.1f}s"
    assert not s.receivers[1].proc.is_alive()
    for j in (0, 2):
        s.verify(j, 2)
    for res in s.update(3):  # the session goes on without it
        assert res["applied"] == [0, 2]
    for j in (0, 2):
        s.verify(j, 3)
        assert s.receivers[j].call("stats")["mixed"] == 0


def test_a_trainer_dying_mid_update_leaves_receivers_on_the_old_version(sessions: list[Session]) -> None:
    s = Session([(2, 0), (2, 1)], [(1, 0), (1, 0), (1, 0)], receiver_timeout_s=3.0)
    sessions.append(s)
    for res in s.update(1):
        assert res["applied"] == [0, 1, 2]
    # Trainer 1 freezes before its share of version 2; trainer 0 writes its half (into the free
    # slot) and its immediate; trainer 1 is then killed. Receivers wait for its immediate in vain.
    dead = s.trainers[1].proc
    assert dead.pid is not None
    stop_process(dead.pid or 0)
    try:
        (res,) = s.update(2, timeout_s=15.0, trainers=[0])
    finally:
        os.kill(dead.pid, signal.SIGKILL)
    assert res["applied"] == []
    assert res["failed"] == [0, 1, 2]  # each abandoned version 2 and said so
    assert res["receiver_versions"] == {0: 1, 1: 1, 2: 1}
    for j in range(3):
        s.verify(j, 1)
        stats = s.receivers[j].call("stats")
        assert stats["mixed"] == 0
        assert stats["abandoned"] == 1
        assert stats["versions"] == [0, 1] or stats["versions"] == [1]
