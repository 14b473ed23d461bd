"""Planner.assign and report on moving time (no HTTP): lease expiry, the reaper, quarantine, exclusion."""

from __future__ import annotations

import time

import pytest

from planner import AllBusy, AssignmentRequest, NoSource, RankManifest, RegistrationRequest, TransferReport
from planner.service import reap
from tests.planner.conftest import identity, make_planner, manifest


def _ready_seed(svc, now: float, limit: int = 1) -> str:
    rank0 = {"rank": 0, "provider": "tcp", "address": "YWRkcjA=", "backends": ["tcp"]}
    body = RegistrationRequest.model_validate(
        {"identity": identity(), "ranks": [rank0], "max_concurrent_pulls": limit}
    )
    seed = svc.register(body, now).id
    svc.put_manifest(seed, 0, RankManifest.model_validate(manifest(0)).model_dump_json(), now)
    svc.set_status(seed, "READY", now)
    return seed


def _ask(**over) -> AssignmentRequest:
    return AssignmentRequest.model_validate(
        {"identity": identity(), "rank": 0, "providers": ["tcp"], **over}
    )


def test_lease_expiry_and_stale_reaper(planner_url):
    svc = make_planner(planner_url, heartbeat_ttl_s=10, lease_ttl_s=5)
    try:
        now = time.time()
        seed = _ready_seed(svc, now, limit=1)
        svc.assign(_ask(), now)
        with pytest.raises(AllBusy):
            svc.assign(_ask(), now + 1)
        # the lease expires by time even before the reaper runs, and the reaper records it
        svc.assign(_ask(), now + 6)
        res = reap(svc.db, svc.settings, now + 12)
        assert res.expired == 2
        assert svc.transfers(limit=10, offset=0, seed_id=seed, outcome="expired").total == 2
        # no heartbeat for > ttl: never assigned, then STALE
        with pytest.raises(NoSource):
            svc.assign(_ask(), now + 11)
        assert res.stale == 1
        assert svc.get(seed).status == "STALE"
        assert svc.heartbeat(seed, now + 13).status == "STALE"  # stays STALE until it sets a status
        with pytest.raises(NoSource):
            svc.assign(_ask(), now + 13)
        svc.set_status(seed, "READY", now + 14)
        assert svc.assign(_ask(), now + 14)
    finally:
        svc.close()


def test_quarantine_after_repeated_failures(planner_url):
    svc = make_planner(planner_url, failure_threshold=2, quarantine_s=60)
    try:
        now = time.time()
        seed = _ready_seed(svc, now, limit=5)
        fail = TransferReport(outcome="failure", reason="transport", error="peer reset")  # the seed's fault
        first = svc.assign(_ask(), now).id
        assert not svc.report(first, fail, now).seed_quarantined
        second = svc.assign(_ask(), now).id
        assert svc.report(second, fail, now).seed_quarantined
        with pytest.raises(NoSource):
            svc.assign(_ask(), now + 1)
        svc.heartbeat(seed, now + 61)
        assert svc.assign(_ask(), now + 61)
    finally:
        svc.close()


def test_requester_is_never_its_own_source(svc):
    now = time.time()
    seed = _ready_seed(svc, now)
    with pytest.raises(NoSource):
        svc.assign(_ask(requester_id=seed), now)
