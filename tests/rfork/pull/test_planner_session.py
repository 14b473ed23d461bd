"""rfork.pull.planner_session: waiting out busy seeds as the planner advises, and falling back when it
says so.
"""

from __future__ import annotations

import random

import pytest

from planner import PlannerServer
from planner.contract import AllBusy, PlannerClient
from rfork.pull.options import BusyWait, LoadOptions
from rfork.pull.planner_session import ask_with_wait, fallback_seconds
from tests.planner.conftest import identity, manifest, ranks

GB = 10**9


@pytest.fixture
def busy_planner(sqlite_url):
    """A planner with one READY seed (limit 1, a 10 GB rank) whose only slot is leased."""
    with PlannerServer(db_url=sqlite_url, insecure=True, assumed_pull_gbps=10.0) as srv:
        c = PlannerClient(srv.url)
        reg = c.register_instance(identity=identity(), ranks=ranks(0, 1), max_concurrent_pulls=1)
        m = manifest(0)
        m["regions"][0]["nbytes"] = 10 * GB  # 1 s at the assumed 10 GB/s
        # ... in a tensor as large (a region larger than its tensors is refused, issue #21)
        m["tensors"][0].update(shape=[10 * GB // 4], nbytes=10 * GB)
        m["tensors"][1]["offset"] = 10 * GB
        c.put_manifest(reg.id, 0, m)
        c.set_status(reg.id, "READY")
        held = c.request_assignment(identity=identity(), rank=0)
        assert held is not None
        yield c, held
        c.close()


def test_waits_the_planners_retry_after_then_gets_the_freed_seed(busy_planner):
    client, held = busy_planner
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        client.report_transfer(held.id, outcome="success", bytes=10 * GB, seconds=1.0, backend="tcp")

    waits: list[float] = []

    def ask(waited_s: float):
        waits.append(waited_s)
        return client.request_assignment(identity=identity(), rank=0, fallback_s=600.0, waited_s=waited_s)

    got = ask_with_wait(ask, policy=BusyWait(jitter=0.1), busy_type=AllBusy, what="rank 0", sleep=sleep)
    assert got is not None
    assert got.candidates[0].instance_id
    assert len(slept) == 1
    assert 0.05 <= slept[0] <= 1.0 * 1.1 + 0.01  # the lease's expected end (<= 1 s away), plus jitter
    assert waits[0] < 0.5
    assert waits[1] >= waits[0]


def test_falls_back_at_once_when_the_planner_says_disk_is_sooner(busy_planner):
    client, _ = busy_planner

    def never(_s: float) -> None:
        raise AssertionError("must not sleep when told to fall back")

    got = ask_with_wait(
        lambda w: client.request_assignment(identity=identity(), rank=0, fallback_s=0.5, waited_s=w),
        policy=BusyWait(),
        busy_type=AllBusy,
        what="rank 0",
        sleep=never,
    )
    assert got is None


def test_policy_bounds_and_estimate():
    class Answer:
        retry_after_s = 2.0
        fallback = False

    rng = random.Random(1)
    p = BusyWait(max_wait_s=10.0, jitter=0.5)
    for _ in range(50):
        s = p.decide(Answer(), 0.0, rng)
        assert s is not None
        assert 2.0 <= s <= 3.0
    assert p.decide(Answer(), 8.5, rng) is None  # would pass max_wait_s
    with pytest.raises(ValueError, match="jitter"):
        BusyWait(jitter=2.0)
    assert fallback_seconds(4 * GB, 2.0) == pytest.approx(2.0)
    assert fallback_seconds(4 * GB, None) is None
    assert fallback_seconds(0, 2.0) is None


def test_a_pull_longer_than_the_lease_keeps_it_by_renewing(sqlite_url):
    """Issue #21: leases lasted lease_ttl_s with no renewal, so a long pull's report got 409 and the seed
    was over-subscribed meanwhile. The session renews the lease while the source is out."""
    import time

    from rfork.identity import SourceIdentity
    from rfork.pull.options import LoadOptions
    from rfork.pull.planner_session import PlannerSession

    with PlannerServer(db_url=sqlite_url, insecure=True, lease_ttl_s=1.0, reaper_interval_s=0.1) as srv:
        c = PlannerClient(srv.url)
        reg = c.register_instance(identity=identity(), ranks=ranks(0, 1), max_concurrent_pulls=1)
        c.put_manifest(reg.id, 0, manifest(0))
        c.set_status(reg.id, "READY")
        session = PlannerSession(
            planner_url=srv.url,
            token=None,
            identity=SourceIdentity.model_validate(identity()),
            options=LoadOptions(providers=["tcp"]),
            fallback_bytes=None,
        )
        sources = session.sources(0)  # held: the loader iterates it while the pull runs
        source = next(sources)
        # two and a half lease lifetimes: the pull goes on. Time itself is the event here (the planner
        # process reads its own clock); without renewals the reaper frees the slot within it
        time.sleep(2.5)
        c.heartbeat(reg.id)
        with pytest.raises(AllBusy):  # the seed's one slot is still taken
            c.request_assignment(identity=identity(), rank=0)
        source.succeeded(64, 2.5)
        assert [t.outcome for t in c.transfers().items] == ["success"]
        session.close()
        c.close()


def test_a_planner_restart_during_the_wait_is_waited_out_not_a_failed_load(sqlite_url):
    # the emulated fleet's planner-restart fault: every loader that asked while the planner was down
    # gave up on it at once (no checkpoint to fall back to: the load failed)
    from bench.processes import free_port
    from planner.contract import PlannerUnavailable

    port = free_port()
    with PlannerServer(db_url=sqlite_url, insecure=True, port=port) as first:
        c = PlannerClient(first.url)
        reg = c.register_instance(identity=identity(), ranks=ranks(0, 1), max_concurrent_pulls=1)
        c.put_manifest(reg.id, 0, manifest(0))
        c.set_status(reg.id, "READY")
        c.close()
    client = PlannerClient(f"http://127.0.0.1:{port}", timeout_s=2.0)
    restarted: list[PlannerServer] = []
    slept: list[float] = []

    def sleep(seconds: float) -> None:  # the planner comes back after the loader's second retry
        slept.append(seconds)
        if len(slept) == 2:
            restarted.append(PlannerServer(db_url=sqlite_url, insecure=True, port=port).start())

    try:
        got = ask_with_wait(
            lambda waited: client.request_assignment(identity=identity(), rank=0, waited_s=waited),
            policy=BusyWait(outage_retry_s=0.2, planner_outage_s=30.0),
            busy_type=AllBusy,
            what="rank 0",
            sleep=sleep,
            outage_type=PlannerUnavailable,
        )
        assert got is not None
        assert got.candidates[0].instance_id == reg.id
        assert slept == [0.2, 0.2]
    finally:
        client.close()
        for srv in restarted:
            srv.close()
    # and a planner that stays down is given up on after planner_outage_s of failures: a bounded error
    now = [0.0]
    down = PlannerClient(f"http://127.0.0.1:{port}", timeout_s=1.0)
    try:
        with pytest.raises(PlannerUnavailable):
            ask_with_wait(
                lambda waited: down.request_assignment(identity=identity(), rank=0),
                policy=BusyWait(outage_retry_s=1.0, planner_outage_s=3.0),
                busy_type=AllBusy,
                what="rank 0",
                sleep=lambda s: now.__setitem__(0, now[0] + s),
                clock=lambda: now[0],
                outage_type=PlannerUnavailable,
            )
        assert now[0] == pytest.approx(3.0)
    finally:
        down.close()


def test_a_loader_whose_pull_failed_asks_again_with_its_place_in_line(sqlite_url):
    # the emulated fleet's cut seed: the loader that lost its pull asked again as a newcomer (waited 0 s)
    # and queued behind every loader that had started with it, losing a whole generation
    import time as _time

    from rfork.identity import SourceIdentity
    from rfork.pull.planner_session import PlannerSession

    with PlannerServer(db_url=sqlite_url, insecure=True) as srv:
        c = PlannerClient(srv.url)
        for _ in range(2):
            reg = c.register_instance(identity=identity(), ranks=ranks(0, 1), max_concurrent_pulls=1)
            c.put_manifest(reg.id, 0, manifest(0))
            c.set_status(reg.id, "READY")
        c.close()
        session = PlannerSession(
            planner_url=srv.url,
            token=None,
            identity=SourceIdentity.model_validate(identity()),
            options=LoadOptions(providers=["tcp"]),
            fallback_bytes=None,
        )
        asked: list[float] = []
        client = session.client
        assert client is not None
        real = client.request_assignment

        def recording(**kw):
            asked.append(kw["waited_s"])
            return real(**kw)

        client.request_assignment = recording  # type: ignore[method-assign]
        sources = session.sources(0)
        first = next(sources)
        _time.sleep(0.3)  # the pull runs, then its seed goes silent
        first.failed(TimeoutError("read timed out"), 0.3)
        second = next(sources)
        assert second.instance_id != first.instance_id
        second.succeeded(64, 0.1)
        session.close()
    assert asked[0] < 0.1
    assert asked[1] >= 0.3  # counted from the rank's first ask, not from this attempt's
