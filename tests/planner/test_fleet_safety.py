"""A planner no single token can turn against its fleet (issue #21, findings 4-9): roles, blame, region
sizes, the waiting room, lock order, retention, lease renewal, the busy window, secrets."""

from __future__ import annotations

import copy
import json
import threading
import time
import tracemalloc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import AllBusy, AssignmentRequest, NoSource, RankManifest, RegistrationRequest, TransferReport
from planner.auth import Authenticator
from planner.burst import WaitingRoom, estimate_busy, slot_time
from planner.contract import AuthError, Conflict, PlannerClient
from planner.server import PlannerServer
from planner.service import Planner
from planner.service.reaper import reap
from planner.settings import PlannerSettings
from tests.planner.conftest import identity, make_planner, manifest, ranks

TOKENS: dict[str, Any] = {
    "admin_token": "adm",
    "register_token": "reg",
    "load_token": "load",
    "reader_token": "read",
}


@pytest.fixture
def secure(planner_url):
    with PlannerServer(db_url=planner_url, port=0, insecure=False, reaper_interval_s=3600, **TOKENS) as srv:
        yield srv


def _ready_seed(svc, now: float, limit: int = 5, ident: dict[str, Any] | None = None) -> str:
    rank0 = {"rank": 0, "provider": "tcp", "address": "YWRkcjA=", "backends": ["tcp"]}
    body = RegistrationRequest.model_validate(
        {"identity": ident or identity(), "ranks": [rank0], "max_concurrent_pulls": limit}
    )
    seed = svc.register(body, now).id
    svc.put_manifest(seed, 0, RankManifest.model_validate(manifest(0)).model_dump_json(), now)
    svc.set_status(seed, "READY", now)
    return seed


def _ask(**over: Any) -> AssignmentRequest:
    return AssignmentRequest.model_validate({"identity": identity(), "rank": 0, "providers": ["tcp"], **over})


# ---- 5: roles ----------------------------------------------------------------------------------


def test_register_never_implies_load(secure):
    """An instance token from a register-only token may change its instance, never lease."""
    seed = PlannerClient(secure.url, token="reg").register_instance(identity=identity(), ranks=ranks(0))
    own = PlannerClient(secure.url, token=seed.token)
    own.put_manifest(seed.id, 0, manifest(0))
    own.set_status(seed.id, "READY")
    other = PlannerClient(secure.url, token="reg").register_instance(identity=identity(), ranks=ranks(0))
    with pytest.raises(AuthError):
        PlannerClient(secure.url, token=other.token).request_assignment(identity=identity(), rank=0)


def test_instance_tokens_lease_only_their_own_identity(planner_url):
    with PlannerServer(
        db_url=planner_url, port=0, reaper_interval_s=3600, load_token="both", register_token="both"
    ) as srv:
        both = PlannerClient(srv.url, token="both")
        reg = both.register_instance(identity=identity(), ranks=ranks(0))
        own = PlannerClient(srv.url, token=reg.token)
        assert own.request_assignment(identity=identity(), rank=0) is None  # its own identity: allowed
        with pytest.raises(AuthError):
            own.request_assignment(identity=identity(revision="other"), rank=0)


# ---- 6: blame ----------------------------------------------------------------------------------


def test_loader_side_faults_never_count_against_the_seed(planner_url):
    svc = make_planner(planner_url, failure_threshold=2, quarantine_s=60)
    try:
        now = time.time()
        seed = _ready_seed(svc, now)
        for reason in ("DestinationMismatch", "PullError", "BackendUnavailable", None):
            lease = svc.assign(_ask(), now).id
            answer = svc.report(lease, TransferReport(outcome="failure", reason=reason), now)
            assert not answer.seed_quarantined
        assert svc.get(seed).quarantined_until is None
        assert svc.assign(_ask(), now)  # still offered
        for who in ("instance:a", "instance:b"):  # transport failures still count (two reporters)
            lease = svc.assign(_ask(), now, holder=who).id
            last = svc.report(lease, TransferReport(outcome="failure", reason="transport"), now, reporter=who)
        assert last.seed_quarantined
    finally:
        svc.close()


def test_one_checksum_report_costs_a_healthy_seed_only_a_reverification(planner_url):
    """A checksum_mismatch report stops offering the seed and asks it (heartbeat) to re-hash; its clean
    republication alone does not bring it back: the next loader that did not accuse it gets it as a
    probation pull, whose verified success disproves the claim (against the reporter) at once."""
    svc = make_planner(planner_url, quarantine_s=300)
    try:
        now = time.time()
        seed = _ready_seed(svc, now)
        lease = svc.assign(_ask(requester_id="liar"), now, holder="load").id
        svc.report(lease, TransferReport(outcome="failure", reason="checksum_mismatch"), now, reporter="load")
        with pytest.raises(NoSource):
            svc.assign(_ask(), now + 1)
        assert svc.heartbeat(seed, now + 1).reverify is True
        svc.put_manifest(seed, 0, RankManifest.model_validate(manifest(0)).model_dump_json(), now + 2)
        assert svc.heartbeat(seed, now + 2).reverify is False
        with pytest.raises(NoSource):  # the liar itself is never its verifier
            svc.assign(_ask(requester_id="liar"), now + 2, holder="load")
        probe = svc.assign(_ask(requester_id="honest"), now + 2, holder="load")
        assert probe.candidates[0].instance_id == seed
        with pytest.raises(NoSource):  # one probation pull at a time
            svc.assign(_ask(requester_id="other"), now + 2, holder="load")
        svc.report(probe.id, TransferReport(outcome="success", bytes=64), now + 3, reporter="load")
        assert svc.assign(_ask(), now + 3)  # back long before quarantine_s
        assert svc.false_reports("load/liar") == 1
        assert svc.false_reports("load/honest") == 0
    finally:
        svc.close()


def test_a_seed_that_fails_reverification_is_never_offered_again_until_clean(planner_url):
    svc = make_planner(planner_url, quarantine_s=1)
    try:
        now = time.time()
        seed = _ready_seed(svc, now)
        lease = svc.assign(_ask(), now).id
        svc.report(lease, TransferReport(outcome="failure", reason="checksum_mismatch"), now)
        svc.heartbeat(seed, now + 5_000)
        with pytest.raises(NoSource):  # it never re-verified: far past quarantine_s, still not offered
            svc.assign(_ask(), now + 5_000)
        bad = manifest(0)
        bad["tensors"][0]["checksum"] = "cd"
        with pytest.raises(Exception, match="digests differ"):
            svc.put_manifest(seed, 0, json.dumps(bad), now + 1)
        svc.heartbeat(seed, now + 10_000)
        with pytest.raises(NoSource):  # far past quarantine_s: still not offered
            svc.assign(_ask(), now + 10_000)
        svc.put_manifest(seed, 0, json.dumps(manifest(0)), now + 10_001)
        assert svc.assign(_ask(), now + 10_001)
    finally:
        svc.close()


# ---- 7: region sizes ---------------------------------------------------------------------------


def test_regions_larger_than_their_tensors_are_refused(server):
    reg = PlannerClient(server.url).register_instance(identity=identity(), ranks=ranks(0))
    huge = copy.deepcopy(manifest(0))
    huge["regions"][0]["nbytes"] = 1 << 50  # 1 PiB behind a 64-byte tensor
    with pytest.raises(Conflict, match="region 0"):
        PlannerClient(server.url).put_manifest(reg.id, 0, huge)


# ---- 4: the waiting room -------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    leases=st.integers(1, 64),
    serves_after=st.integers(0, 10_000),
    position=st.integers(0, 100_000),
)
def test_slot_time_is_bounded_for_100k_waiters(leases, serves_after, position):
    ends = [10.0 + i * 0.01 for i in range(leases)]
    t0 = time.perf_counter()
    got = slot_time(lease_ends=ends, position=position, pull_s=5.0, serves_after=serves_after)
    assert time.perf_counter() - t0 < 0.05
    assert got >= ends[0]
    # one generation later at most every ~log(position) pulls when each finisher serves
    assert got <= ends[-1] + 5.0 * (position // leases + 1)


def test_slot_time_matches_the_replay_on_small_queues():
    import heapq

    def replay(ends: list[float], position: int, pull_s: float, serves_after: int) -> float:
        slots = [e for e in ends for _ in range(1 + serves_after)]
        heapq.heapify(slots)
        for _ in range(position):
            t = heapq.heappop(slots)
            for _ in range(1 + serves_after):
                heapq.heappush(slots, t + pull_s)
        return slots[0]

    for ends in ([10.0], [10.0, 10.0], [10.0, 11.0, 14.0], [10.0, 30.0]):
        for serves_after in range(4):
            for position in range(40):
                assert slot_time(
                    lease_ends=ends, position=position, pull_s=5.0, serves_after=serves_after
                ) == replay(ends, position, 5.0, serves_after), (ends, serves_after, position)


def test_waiting_room_with_100k_waiters_is_bounded_in_time_and_memory():
    room = WaitingRoom()
    key = ("k", 0)
    t0 = time.perf_counter()
    for i in range(100_000):
        room.promise(key, at=1e9 + i, since=float(i))
    for i in range(0, 100_000, 1000):  # every 1000th waiter asks again (none has been promised yet)
        assert room.position(key, now=2e5, since=float(i)) == i
    assert time.perf_counter() - t0 < 3.0  # ~0.25 s here; generous for a shared 2-core box
    tracemalloc.start()
    more = WaitingRoom(max_waiters=10_000)
    for i in range(20_000):  # past its bound: the newcomers are not kept
        more.promise(("k", i % 7), at=1e9, since=float(i))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert more.size() == 10_000
    assert peak < 8 << 20  # ~100 bytes a waiter
    est = estimate_busy(
        lease_starts=[0.0],
        rank_bytes=10**9,
        rate_bps=10**9,
        now=0.5,
        position=99_999,
        serves_after=10_000,
        min_s=0.05,
        max_s=60.0,
    )
    assert est.retry_after_s <= 60.0
    for k in range(200):  # many keys do not grow memory without bound either
        room.promise((f"k{k}", 0), at=1e9, since=0.0)
    assert room.size() <= room.max_waiters
    room.position(key, now=2e9, since=2e9)  # every promise has passed: the room empties
    assert room.size() == 0


def test_the_busy_estimate_runs_outside_the_write_lock(planner_url, monkeypatch):
    """While the 429's arithmetic runs, another write (a heartbeat) goes through."""
    import planner.service.busy as busy

    svc = make_planner(planner_url)
    try:
        now = time.time()
        seed = _ready_seed(svc, now, limit=1)
        svc.assign(_ask(), now)
        beat_done: list[bool] = []
        real = busy.estimate_busy

        def slow_estimate(**kw: Any) -> Any:
            t = threading.Thread(target=lambda: beat_done.append(bool(svc.heartbeat(seed, now))))
            t.start()
            t.join(5.0)
            return real(**kw)

        monkeypatch.setattr(busy, "estimate_busy", slow_estimate)
        with pytest.raises(AllBusy):
            svc.assign(_ask(), now)
        assert beat_done == [True]
    finally:
        svc.close()


# ---- 8: lock order, retention, renewal, busy window ------------------------------------------


@pytest.mark.postgres
def test_concurrent_report_and_delete_never_deadlock_on_postgres(postgres_url):
    from tests.planner.conftest import empty_database

    svc = Planner.open(PlannerSettings(db_url=empty_database(postgres_url), insecure=True, db_pool_size=8))
    errors: list[BaseException] = []
    try:
        for _ in range(30):
            now = time.time()
            seed = _ready_seed(svc, now)
            lease = svc.assign(_ask(), now).id
            barrier = threading.Barrier(2)

            def report(lease: str = lease, barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                try:
                    svc.report(lease, TransferReport(outcome="failure", reason="transport"), None)
                except (Conflict, NoSource, Exception) as exc:  # noqa: BLE001 - sorted below
                    if "deadlock" in str(exc).lower():
                        errors.append(exc)

            def remove(seed: str = seed, barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                try:
                    svc.delete(seed, time.time())
                except Exception as exc:  # noqa: BLE001 - sorted below
                    if "deadlock" in str(exc).lower():
                        errors.append(exc)

            threads = [threading.Thread(target=report), threading.Thread(target=remove)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        svc.close()
    assert errors == []


def test_stale_instances_and_their_manifests_are_deleted_after_retention(planner_url):
    svc = make_planner(planner_url, heartbeat_ttl_s=10, stale_retention_s=100)
    try:
        now = time.time()
        seed = _ready_seed(svc, now)
        reap(svc.db, svc.settings, now + 20)
        assert svc.get(seed).status == "STALE"
        reap(svc.db, svc.settings, now + 60)
        assert svc.get(seed).status == "STALE"  # within retention: kept (it may come back)
        result = reap(svc.db, svc.settings, now + 200)
        assert result.deleted == 1
        with pytest.raises(Exception, match="not found"):
            svc.get(seed)
        with pytest.raises(Exception, match="no manifest"):
            svc.get_manifest(seed, 0)
    finally:
        svc.close()


def test_a_lease_holder_renews_its_lease_for_a_long_pull(planner_url):
    svc = make_planner(planner_url, lease_ttl_s=120)
    try:
        now = time.time()
        _ready_seed(svc, now, limit=1)
        lease = svc.assign(_ask(), now)
        renewed = svc.renew(lease.id, now + 100, holder=None)
        assert renewed.expires_at_unix == pytest.approx(now + 220)
        svc.heartbeat(lease.candidates[0].instance_id, now + 150)
        with pytest.raises(AllBusy):  # the slot stays taken past the first expiry
            svc.assign(_ask(), now + 150)
        answer = svc.report(lease.id, TransferReport(outcome="success", bytes=1, seconds=190), now + 190)
        assert answer.outcome == "success"
        with pytest.raises(Conflict):  # an ended lease is not renewed
            svc.renew(lease.id, now + 191, holder=None)
    finally:
        svc.close()


def test_the_busy_estimate_reads_a_bounded_window_of_history(planner_url):
    """Finished leases older than the window no longer feed the rate."""
    svc = make_planner(planner_url, rate_history_s=3600, assumed_pull_gbps=1.0)
    try:
        now = time.time()
        _ready_seed(svc, now, limit=1)
        old = svc.assign(_ask(), now - 7200).id  # a very slow pull long ago: 64 bytes in 640 s
        svc.report(old, TransferReport(outcome="success", bytes=64, seconds=640.0), now - 7200)
        svc.assign(_ask(), now)
        with pytest.raises(AllBusy) as busy:
            svc.assign(_ask(), now)
        assert (busy.value.expected_pull_s or 0.0) < 1.0  # the assumed 1 GB/s, not 0.1 B/s from two hours ago
    finally:
        svc.close()


# ---- 9: secrets ------------------------------------------------------------------------------


def test_unknown_instance_tokens_are_cached_negatively(planner_url):
    from planner.db import Database

    db = Database(planner_url)
    try:
        auth = Authenticator(db=db, admin="adm", reader=None)
        assert auth.authenticate("rfi_" + "x" * 40) is None
        assert auth.authenticate_cached("rfi_" + "x" * 40) is None  # answered without the database
    finally:
        db.close()


def test_instance_tokens_stay_cached_longer_than_a_heartbeat_interval_and_no_longer(planner_url, monkeypatch):
    """A seed heartbeats every ttl/3 (at most 10 s): its token must still be cached at the next beat (the
    hot path answers only cached tokens), and a deleted instance's token is refused within CACHE_S."""
    from planner import auth as auth_mod
    from planner.db import Database

    svc = make_planner(planner_url)
    db = Database(planner_url)
    clock = [1000.0]
    monkeypatch.setattr(auth_mod.time, "monotonic", lambda: clock[0])
    try:
        reg = svc.register(
            RegistrationRequest.model_validate({"identity": identity(), "ranks": []}), time.time()
        )
        auth = Authenticator(db=db, admin="adm", reader=None)
        assert auth.authenticate(reg.token) is not None  # looked up once
        svc.delete(reg.id, time.time())  # in "another process": this cache is not told
        clock[0] += 10.0
        cached = auth.authenticate_cached(reg.token)
        assert cached is not None  # the next heartbeat, 10 s later, is answered from the cache
        assert cached is not False
        clock[0] += auth_mod.CACHE_S
        assert auth.authenticate_cached(reg.token) is False  # expired: looked up again ...
        assert auth.authenticate(reg.token) is None  # ... and refused
    finally:
        db.close()
        svc.close()


def test_no_token_in_reprs_or_logs(server, caplog):
    reg = PlannerClient(server.url).register_instance(identity=identity(), ranks=ranks(0))
    assert reg.token not in repr(reg)
    assert reg.token not in str(reg)
    client = PlannerClient(server.url, token="sekrit-token")
    assert "sekrit-token" not in repr(client)
    assert "sekrit-token" not in caplog.text


def test_the_database_holds_no_key_that_forges_control_tokens(planner_url):
    from sqlalchemy import create_engine, text

    from planner.contract import control_token

    svc = make_planner(planner_url, control_secret="planner-secret-" + "z" * 32)
    try:
        key = control_token.new_control_key()
        body = RegistrationRequest.model_validate(
            {
                "identity": identity(),
                "ranks": [{"rank": 0, "provider": "tcp", "address": "YWRkcjA=", "backends": ["tcp"]}],
                "control_url": "http://127.0.0.1:9",
                "control_key": key,
            }
        )
        now = time.time()
        reg = svc.register(body, now)
        svc.put_manifest(reg.id, 0, json.dumps(manifest(0)), now)
        svc.set_status(reg.id, "READY", now)
        eng = create_engine(planner_url)
        with eng.connect() as conn:
            dumped = " ".join(str(v) for row in conn.execute(text("SELECT * FROM instances")) for v in row)
        eng.dispose()
        assert key not in dumped  # a dump of the database forges no control token
        lease = svc.assign(_ask(), now)
        token = lease.candidates[0].control_token
        assert token is not None
        # the seed's check
        grant = control_token.verify_control_token(token, key, instance_ids=[reg.id], rank=0, now=now)
        assert grant.lease_id == lease.id
    finally:
        svc.close()
