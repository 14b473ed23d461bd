"""Burst behaviour: Retry-After from live leases and recorded rates, the waiting room, the fallback advice."""

from __future__ import annotations

import itertools
import json
import math
import threading
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import AllBusy, AssignmentRequest, RegistrationRequest, TransferReport, migrate
from planner.burst import WaitingRoom, estimate_busy, pull_rate_bps, slot_time
from planner.contract import PlannerClient
from tests.planner.conftest import identity, make_planner, manifest, ranks

GB = 10**9


def max_concurrent(intervals: list[tuple[Any, Any]]) -> int:
    """Most intervals open at one instant (an interval ending when another starts does not overlap it)."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    return max(itertools.accumulate(step for _, step in points), default=0)


# ---- the arithmetic ---------------------------------------------------------------------------


def test_pull_rate_is_total_bytes_over_total_seconds_and_skips_empty_records():
    assert pull_rate_bps([(100, 1.0), (300, 1.0), (None, 5.0), (50, 0.0)], default_bps=7) == 200
    assert pull_rate_bps([], default_bps=7) == 7


def test_slot_time_without_new_seeds_serves_limit_per_pull():
    # two leases ending at 10, pulls of 5 s, nobody becomes a seed: waiters 0,1 at 10; 2,3 at 15; 4,5 at 20
    got = [slot_time(lease_ends=[10, 10], position=p, pull_s=5, serves_after=0) for p in range(6)]
    assert got == [10, 10, 15, 15, 20, 20]


def test_slot_time_with_new_seeds_grows_like_a_tree():
    # one lease ending at 10; each finisher then serves 1: slots double every pull
    got = [slot_time(lease_ends=[10], position=p, pull_s=5, serves_after=1) for p in range(8)]
    assert got == [10, 10, 15, 15, 15, 15, 20, 20]


@settings(max_examples=200, deadline=None)
@given(
    starts=st.lists(st.floats(0, 100), min_size=1, max_size=8),
    rank_gb=st.floats(0.001, 1000),
    rate_gbps=st.floats(0.01, 100),
    now=st.floats(0, 200),
    position=st.integers(0, 50),
    serves_after=st.integers(0, 4),
    fallback_s=st.none() | st.floats(0.01, 10_000),
)
def test_estimate_properties(starts, rank_gb, rate_gbps, now, position, serves_after, fallback_s):
    kw = {
        "lease_starts": sorted(starts),
        "rank_bytes": int(rank_gb * GB),
        "rate_bps": rate_gbps * GB,
        "now": now,
        "serves_after": serves_after,
        "fallback_s": fallback_s,
        "min_s": 0.05,
        "max_s": 60.0,
    }
    est = estimate_busy(position=position, **kw)
    later = estimate_busy(position=position + 1, **kw)
    pull = int(rank_gb * GB) / (rate_gbps * GB)
    assert est.expected_pull_s == pytest.approx(pull)
    assert 0.05 <= est.retry_after_s <= 60.0
    assert later.retry_after_s >= est.retry_after_s  # a later place in line never comes back sooner
    if fallback_s is None:
        assert not est.fallback
    elif est.fallback:
        assert later.fallback  # whoever is behind a waiter told to fall back is told so too
    # unclamped: the first slot opens when the earliest lease is expected to end
    first = estimate_busy(position=0, **{**kw, "min_s": 1e-9, "max_s": 1e9})
    assert first.retry_after_s == pytest.approx(max(min(starts) + pull - now, 1e-9), rel=1e-9, abs=1e-6)


def test_fallback_exactly_when_waiting_plus_pull_is_not_sooner():
    kw: dict[str, Any] = {
        "lease_starts": [0.0],
        "rank_bytes": 10 * GB,
        "rate_bps": 1 * GB,
        "now": 4.0,
        "min_s": 0.01,
    }
    # slot at 10 (6 s from now) + 10 s pull = 16 s
    assert not estimate_busy(fallback_s=16.5, max_s=60, **kw).fallback
    assert estimate_busy(fallback_s=15.5, max_s=60, **kw).fallback
    assert estimate_busy(fallback_s=None, max_s=60, **kw).retry_after_s == pytest.approx(6.0)
    assert estimate_busy(fallback_s=None, max_s=2, **kw).retry_after_s == 2  # clamped
    gone = estimate_busy(lease_starts=[], rank_bytes=1, rate_bps=1, now=0, min_s=0.3, max_s=9)
    assert gone.retry_after_s == 0.3
    with pytest.raises(ValueError, match="rate_bps"):
        estimate_busy(lease_starts=[0], rank_bytes=1, rate_bps=0, now=0, min_s=0.1, max_s=1)


def test_waiting_room_is_first_come_first_served_and_forgets_past_promises():
    room = WaitingRoom()
    key = ("k", 0)
    assert room.position(key, now=0, since=0) == 0
    room.promise(key, at=10, since=0, tie="a")
    assert room.position(key, now=0, since=0) == 1  # a newcomer at the same instant queues behind
    room.promise(key, at=12, since=0, tie="b")
    room.promise(key, at=14, since=1, tie="c")
    assert room.position(key, now=2, since=2) == 3
    # the first waiter comes back at 10 and must wait again: it keeps its place ahead of the others
    assert room.position(key, now=10, since=-1) == 0
    assert room.position(key, now=10, since=0.5) == 1  # one that started at 0.5: behind the one at 0
    room.promise(key, at=13, since=0, tie="b")  # asking again replaces its promise, no second place
    assert room.size() == 2
    room.leave(key, since=0, tie="b")  # it got its slot
    assert room.position(key, now=10, since=0.5) == 0
    assert room.position(key, now=20, since=20) == 0  # every promise has passed
    assert room.position(("other", 0), now=0, since=0) == 0


# ---- the service, on moving time ------------------------------------------------------------


def _seed(svc, now: float, *, limit: int, nbytes: int = 64) -> str:
    body = RegistrationRequest.model_validate(
        {
            "identity": identity(),
            "labels": {"node": "s", "rack": "r", "zone": "z"},
            "ranks": [{**r, "address": "YWRkcg=="} for r in ranks(0, 1)],
            "max_concurrent_pulls": limit,
        }
    )
    iid = svc.register(body, now).id
    m = manifest(0)
    m["regions"][0]["nbytes"] = nbytes
    svc.put_manifest(iid, 0, json.dumps(m), now)
    svc.set_status(iid, "READY", now)
    return iid


def _ask(**over):
    return AssignmentRequest.model_validate(
        {"identity": identity(), "rank": 0, "providers": ["tcp"], "backends": ["tcp"], **over}
    )


def test_retry_after_from_live_leases_and_recorded_rate(sqlite_url):
    migrate(sqlite_url)
    svc = make_planner(sqlite_url, assumed_pull_gbps=1.0, retry_after_min_s=0.01)
    try:
        now = 1000.0
        _seed(svc, now, limit=1, nbytes=4 * GB)
        lease = svc.assign(_ask(), now).id
        # nothing recorded yet: 4 GB at the assumed 1 GB/s; the lease started at 1000, so ends at 1004
        with pytest.raises(AllBusy) as busy:
            svc.assign(_ask(), now + 1)
        assert busy.value.retry_after_s == pytest.approx(3.0)
        assert busy.value.expected_pull_s == pytest.approx(4.0)
        assert not busy.value.fallback
        # the next newcomer is second in line: the lease's slot at 1004, then that waiter's pull: 1008
        with pytest.raises(AllBusy) as second:
            svc.assign(_ask(), now + 1)
        assert second.value.retry_after_s == pytest.approx(7.0)
        # ... unless the waiter says it will serve once loaded: nothing changes for the second in line
        # here (one slot), but a requester whose disk load is sooner is told to fall back
        with pytest.raises(AllBusy) as hurry:
            svc.assign(_ask(fallback_s=5.0), now + 1)
        assert hurry.value.fallback
        svc.report(lease, TransferReport(outcome="success", bytes=4 * GB, seconds=2.0), now + 2)
        # a recorded pull: 2 GB/s from now on
        lease2 = svc.assign(_ask(), now + 2).id
        with pytest.raises(AllBusy) as busy2:
            svc.assign(_ask(waited_s=100.0), now + 2.5)  # waited longest: first in line
        assert busy2.value.expected_pull_s == pytest.approx(2.0)
        assert busy2.value.retry_after_s == pytest.approx(1.5)
        assert lease2
    finally:
        svc.close()


def test_http_429_carries_the_estimate_and_a_retry_after_header(server):
    with PlannerClient(server.url) as c:
        reg = c.register_instance(identity=identity(), ranks=ranks(0, 1), max_concurrent_pulls=1)
        big = manifest(0)
        big["regions"][0]["nbytes"] = 100 * GB  # 100 s at the assumed 1 GB/s
        # ... in one tensor as large (a region larger than its tensors is refused, issue #21)
        big["tensors"][0].update(shape=[25 * GB], nbytes=100 * GB)
        big["tensors"][1]["offset"] = 100 * GB
        c.put_manifest(reg.id, 0, big)
        c.set_status(reg.id, "READY")
        assert c.request_assignment(identity=identity(), rank=0) is not None
        with pytest.raises(AllBusy) as busy:
            c.request_assignment(identity=identity(), rank=0, fallback_s=50, serves_after=2, waited_s=1.0)
        assert busy.value.fallback
        assert busy.value.expected_pull_s == pytest.approx(100.0)
    body = {"identity": identity(), "rank": 0, "providers": ["tcp"], "backends": ["tcp"]}
    r = httpx.post(f"{server.url}/v1/assignments", json=body)
    assert r.status_code == 429
    doc = r.json()
    assert doc["reason"] == "all_busy"
    assert doc["fallback"] is False
    assert doc["retry_after_s"] == 60.0  # the lease ends in ~100 s; clamped to retry_after_max_s
    assert int(r.headers["Retry-After"]) == max(1, round(doc["retry_after_s"]))
    bad = httpx.post(f"{server.url}/v1/assignments", json={**body, "fallback_s": -1, "serves_after": -2})
    assert bad.status_code == 422
    assert "fallback_s" in bad.text
    assert math.isfinite(doc["expected_pull_s"])


def test_recorded_leases_never_show_a_seed_over_its_limit(server):
    """Many threads lease and report at once: lease times are read under the write lock, so the
    recorded history follows the order of the decisions and never overlaps beyond the limit."""
    with PlannerClient(server.url) as c:
        reg = c.register_instance(identity=identity(), ranks=ranks(0, 1), max_concurrent_pulls=2)
        c.put_manifest(reg.id, 0, manifest(0))
        c.set_status(reg.id, "READY")
    errors: list[BaseException] = []

    def worker() -> None:
        with PlannerClient(server.url) as client:
            done = 0
            while done < 6:
                try:
                    a = client.request_assignment(identity=identity(), rank=0)
                except AllBusy:
                    continue
                except BaseException as exc:  # surfaced by the assertion below
                    errors.append(exc)
                    return
                assert a is not None
                client.report_transfer(a.id, outcome="success", bytes=64, seconds=0.001, backend="tcp")
                done += 1

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    with PlannerClient(server.url) as c:
        items = c.transfers(limit=1000).items
    assert len(items) == 36
    spans = [(t.created_at, t.ended_at) for t in items if t.ended_at is not None]
    assert len(spans) == 36  # every lease ended
    assert max_concurrent(spans) <= 2


@settings(max_examples=200, deadline=None)
@given(
    ago=st.lists(st.floats(0, 100), min_size=1, max_size=12),
    pull=st.floats(0.01, 50),
    position=st.integers(0, 200),
    serves_after=st.integers(0, 4),
)
def test_estimate_reads_one_start_and_matches_the_replay_of_every_lease(ago, pull, position, serves_after):
    # the 429 reads the live leases' count and one start (planner.service._LiveStarts); the answer is
    # the replay over every lease's end, as before
    now = 1000.0
    starts = sorted(now - a for a in ago)
    read: list[int] = []

    class Lazy(list):
        def __getitem__(self, i):
            read.append(i)
            return super().__getitem__(i)

    est = estimate_busy(
        lease_starts=Lazy(starts), rank_bytes=int(pull * GB), rate_bps=GB, now=now,
        position=position, serves_after=serves_after, min_s=1e-9, max_s=1e9,
    )  # fmt: skip
    ends = [max(s + int(pull * GB) / GB, now) for s in starts]
    want = slot_time(
        lease_ends=ends, position=position, pull_s=int(pull * GB) / GB, serves_after=serves_after
    )
    assert est.retry_after_s == pytest.approx(max(want - now, 1e-9), rel=1e-12, abs=1e-9)
    assert len(read) <= 3


# ---- the herd at 10,000: waiters that started at the same instant ------------------------------


def test_waiters_that_started_at_the_same_instant_get_distinct_places_and_spread_retry_after():
    # every loader first asked at t = 0, so every re-ask says the same `since`; before, all of them got
    # position 0 and the same Retry-After: the herd that stopped the 10,000-instance simulation
    room = WaitingRoom()
    key = ("k", 0)
    pull = 5.0
    kw: dict[str, Any] = {"lease_starts": [-3.0, -2.5], "rank_bytes": int(pull * GB), "rate_bps": GB}
    kw.update(min_s=0.05, max_s=60)  # two live leases, ending at 2 and 2.5

    def ask(now: float, i: int) -> float:
        pos = room.position(key, now, since=0.0, tie=f"node{i}")
        est = estimate_busy(now=now, position=pos, **kw)
        room.promise(key, now + est.retry_after_s, since=0.0, tie=f"node{i}", now=now)
        return est.retry_after_s

    first = [ask(0.0, i) for i in range(6)]
    assert first == pytest.approx([2, 2.5, 7, 7.5, 12, 12.5])  # arrival order
    # all six ask again at t = 1, in another order: each keeps its place (before: all were told 1.0)
    again = {i: ask(1.0, i) for i in reversed(range(6))}
    assert [again[i] for i in range(6)] == pytest.approx([t - 1 for t in first])
    assert sorted(room.position(key, 1.0, since=0.0, tie=f"node{i}") for i in range(6)) == list(range(6))


@settings(max_examples=100, deadline=None)
@given(ties=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=40, unique=True))
def test_same_instant_waiters_take_every_place_once(ties):
    room = WaitingRoom()
    for t in ties:
        room.promise(("k", 0), at=100, since=1.0, tie=t, now=2)
    places = sorted(room.position(("k", 0), now=2, since=1.0, tie=t) for t in ties)
    assert places == list(range(len(ties)))


def test_an_overdue_lease_is_due_now():
    # a lease past its expected end frees its slot any moment: its waiter asks again at the minimum.
    # A grace (a backoff growing with how late it ran) left freed slots idle: 2.3-4.7x the ideal tree
    # in `rfork simulate scale-out --instances 2000`, against 1.12x without it.
    kw: dict[str, Any] = {"lease_starts": [0.0], "rank_bytes": 10 * GB, "rate_bps": GB}
    kw.update(min_s=0.05, max_s=60)
    for now in (10.0, 11.0, 14.0, 40.0):
        assert estimate_busy(now=now, **kw).retry_after_s == pytest.approx(0.05)


# ---- returning waiters whose `since` drifts (a real loader's waited_s is measured on its own clock) ----


def test_a_returning_waiter_keeps_its_place_when_its_since_drifts():
    room = WaitingRoom()
    key = ("k", 0)
    room.promise(key, at=10, since=0.0, tie="a", now=0.0)
    room.promise(key, at=12, since=0.01, tie="b", now=0.01)
    # "a" comes back three times, each time its since = planner clock - its own waited_s is a little off
    for now, since in ((5.0, 0.004), (6.0, -0.003), (7.0, 0.012)):
        assert room.position(key, now, since, tie="a") == 0
        room.promise(key, at=now + 3, since=since, tie="a", now=now)
    assert room.size() == 2  # no ghost places left behind by the re-asks
    assert room.position(key, 7.5, 0.02, tie="b") == 1
    room.leave(key, since=0.007, tie="a")
    assert room.position(key, 7.5, 0.02, tie="b") == 0


def test_a_waiters_retry_after_does_not_grow_with_another_waiters_re_asks(sqlite_url):
    # measured on the emulated fleet: every re-ask of one loader added a place ahead of the others, so
    # that a loader told position 7 of 5 slept a whole pull (17 s) while new seeds stood free
    migrate(sqlite_url)
    svc = make_planner(sqlite_url, assumed_pull_gbps=1.0, retry_after_min_s=0.01, busy_cache_s=0.0)
    try:
        now = 1000.0
        _seed(svc, now, limit=1, nbytes=4 * GB)
        svc.assign(_ask(), now)  # the only slot: its lease ends at 1004
        with pytest.raises(AllBusy) as a:
            svc.assign(_ask(labels={"node": "a"}), now + 0.1)
        with pytest.raises(AllBusy) as b:
            svc.assign(_ask(labels={"node": "b"}), now + 0.2)
        assert a.value.retry_after_s == pytest.approx(3.9)
        assert b.value.retry_after_s == pytest.approx(7.8)  # second in line: the first waiter's pull
        for i, t in enumerate((1.0, 1.5, 2.0)):  # "a" asks again early, its waited_s a little off each time
            with pytest.raises(AllBusy) as again:
                svc.assign(_ask(labels={"node": "a"}, waited_s=t - 0.1 - 0.003 * (i + 1)), now + t)
            assert again.value.retry_after_s == pytest.approx(4.0 - t)
        with pytest.raises(AllBusy) as b2:
            svc.assign(_ask(labels={"node": "b"}, waited_s=2.3 - 0.2 + 0.004), now + 2.3)
        assert b2.value.retry_after_s == pytest.approx(8.0 - 2.3)
    finally:
        svc.close()


# ---- a seed's NIC is shared by its pulls: a loader that will serve pulls alone (solo_pulls_for_seeds) ----


def test_a_loader_that_will_serve_waits_for_an_idle_seed_rather_than_share_one(sqlite_url):
    # on the emulated fleet (500 Mbit/s NICs, 0.5 GB) two pulls from one seed ran 17.4 s each instead of
    # 8.7 s: the first new seeds appeared after two transfer times, and the tree lagged the ideal 1.4x
    migrate(sqlite_url)
    svc = make_planner(sqlite_url, assumed_pull_gbps=1.0, retry_after_min_s=0.01, busy_cache_s=0.0)
    try:
        now = 1000.0
        _seed(svc, now, limit=2, nbytes=4 * GB)
        svc.assign(_ask(labels={"node": "a"}, serves_after=2), now)
        with pytest.raises(AllBusy) as busy:  # the seed's second slot would halve the first pull's rate
            svc.assign(_ask(labels={"node": "b"}, serves_after=2), now + 1)
        # its slot: the live pull ends at 1004, and then two seeds serve (fan-out 2, not 3)
        assert busy.value.retry_after_s == pytest.approx(3.0)
        # a loader that will not serve (first-seed-only) still fills the seed's limit
        assert svc.assign(_ask(labels={"node": "c"}, serves_after=0), now + 1).candidates
    finally:
        svc.close()
    off = make_planner(sqlite_url, solo_pulls_for_seeds=False, busy_cache_s=0.0)
    try:
        _seed(off, 2000.0, limit=2, nbytes=4 * GB)
        off.assign(_ask(labels={"node": "a"}, serves_after=2), 2000.0)
        assert off.assign(_ask(labels={"node": "b"}, serves_after=2), 2001.0).candidates
    finally:
        off.close()


def test_a_seed_about_to_appear_is_due_now_for_the_429(sqlite_url):
    # on the emulated fleet a loader asked 50 ms before a freshly loaded instance published its seed:
    # the pull it had reported was no longer a live lease, the seed not yet READY, so the 429 said
    # "a whole pull" (8.7 s) and the loader slept through the seed that appeared a moment later
    migrate(sqlite_url)
    svc = make_planner(sqlite_url, assumed_pull_gbps=1.0, retry_after_min_s=0.01, busy_cache_s=0.0)
    try:
        now = 1000.0
        _seed(svc, now, limit=1, nbytes=4 * GB)
        a = svc.assign(_ask(labels={"node": "a"}, serves_after=1), now).id
        svc.report(a, TransferReport(outcome="success", bytes=4 * GB, seconds=4.0), now + 4)
        svc.assign(_ask(labels={"node": "b"}, serves_after=1), now + 4.01)  # takes the freed seed
        with pytest.raises(AllBusy) as busy:  # "a" reported and will serve: its seed is due now
            svc.assign(_ask(labels={"node": "c"}, serves_after=1), now + 4.02)
        assert busy.value.retry_after_s == pytest.approx(0.01)
        body = RegistrationRequest.model_validate(
            {
                "identity": identity(),
                "labels": {"node": "a", "rack": "r", "zone": "z"},
                "ranks": [{**r, "address": "YWRkcg=="} for r in ranks(0, 1)],
                "max_concurrent_pulls": 1,
            }
        )
        iid = svc.register(body, now + 4.1).id
        m = manifest(0)
        m["regions"][0]["nbytes"] = 4 * GB
        svc.put_manifest(iid, 0, json.dumps(m), now + 4.1)
        svc.set_status(iid, "READY", now + 4.1)
        assert (
            svc.assign(_ask(labels={"node": "c"}, serves_after=1, waited_s=0.1), now + 4.12)
            .candidates[0]
            .instance_id
            == iid
        )
        with pytest.raises(AllBusy) as later:  # the seed appeared (and is taken): a whole pull again
            svc.assign(_ask(labels={"node": "d"}, serves_after=1), now + 4.13)
        assert later.value.retry_after_s > 3.0
    finally:
        svc.close()


def test_after_a_restart_a_reported_pull_still_counts_as_a_seed_about_to_appear(sqlite_url):
    # the emulated fleet's planner restart: the new process had no memory of which leases' loaders
    # would serve, told a waiter a whole pull while such a loader published its seed, and the fleet
    # lost a generation
    migrate(sqlite_url)
    first = make_planner(sqlite_url, assumed_pull_gbps=1.0, retry_after_min_s=0.01, busy_cache_s=0.0)
    now = 1000.0
    try:
        _seed(first, now, limit=1, nbytes=4 * GB)
        a = first.assign(_ask(labels={"node": "a"}, serves_after=1), now).id
        # recorded at 0.1 GB/s: a pull takes 40 s
        first.report(a, TransferReport(outcome="success", bytes=4 * GB, seconds=40.0), now + 4)
        first.assign(_ask(labels={"node": "b"}, serves_after=1), now + 4.01)  # takes the freed seed
    finally:
        first.close()
    again = make_planner(sqlite_url, assumed_pull_gbps=1.0, retry_after_min_s=0.01, busy_cache_s=0.0)
    try:
        with pytest.raises(AllBusy) as busy:  # "a"'s seed is due any moment, not in a whole pull
            again.assign(_ask(labels={"node": "c"}, serves_after=1), now + 4.02)
        assert busy.value.retry_after_s == pytest.approx(0.01)
        with pytest.raises(AllBusy) as later:  # 5 s on, no seed came: the lease is history
            again.assign(_ask(labels={"node": "d"}, serves_after=1), now + 9.5)
        assert later.value.retry_after_s > 30.0  # "b"'s pull ends at 1044
    finally:
        again.close()
