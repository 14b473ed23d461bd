"""Planner.assign and report on moving time (no HTTP): lease expiry, the reaper, quarantine, exclusion."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Connection

from planner import AllBusy, AssignmentRequest, NoSource, RankManifest, RegistrationRequest, TransferReport
from planner.contract import Assignment, NotFound, ReportAnswer
from planner.service.reaper import reap
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
    return AssignmentRequest.model_validate({"identity": identity(), "rank": 0, "providers": ["tcp"], **over})


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
        first = svc.assign(_ask(), now, holder="instance:a").id
        assert not svc.report(first, fail, now, reporter="instance:a").seed_quarantined
        second = svc.assign(_ask(), now, holder="instance:b").id  # a second reporter corroborates
        assert svc.report(second, fail, now, reporter="instance:b").seed_quarantined
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


def test_write_batch_counts_limits_in_order_and_keeps_refusals_apart(planner_url):
    """One batch (Planner.write_batch, as planner.writes runs it): the second assignment sees the first's
    lease (limit 1: 429), a refusal (NoSource, another holder's report) leaves the others' writes."""
    svc = make_planner(planner_url)
    try:
        now = time.time()
        seed = _ready_seed(svc, now, limit=1)
        other = AssignmentRequest.model_validate(
            {"identity": {**identity(), "model": "no-such-model"}, "rank": 0, "providers": ["tcp"]}
        )

        def asking(body: AssignmentRequest, holder: str) -> Callable[[Connection], Callable[[], Any]]:
            return lambda s: svc.assign_in(s, body, None, holder)

        def reporting(lease: str, reporter: str) -> Callable[[Connection], Callable[[], Any]]:
            def step(s: Connection) -> Callable[[], Any]:
                answer = svc.report_in(s, lease, ok, None, reporter)
                return lambda: answer

            return step

        ok = TransferReport(outcome="success", bytes=10, seconds=1.0)
        out = svc.write_batch([asking(_ask(), "alice"), asking(_ask(), "alice"), asking(other, "alice")])
        assert isinstance(out[0], Assignment)
        assert out[0].candidates[0].instance_id == seed
        assert isinstance(out[1], AllBusy)
        assert isinstance(out[2], NoSource)
        lease = out[0].id
        refused, reported, unknown, again = svc.write_batch(
            [
                reporting(lease, "mallory"),  # not its lease
                reporting(lease, "alice"),
                reporting("0" * 32, "alice"),  # no such lease
                asking(_ask(), "bob"),  # the slot is free again
            ]
        )
        assert isinstance(refused, PermissionError)
        assert isinstance(reported, ReportAnswer)
        assert reported.outcome == "success"
        assert isinstance(unknown, NotFound)
        assert isinstance(again, Assignment)
        assert again.candidates[0].instance_id == seed
        assert svc.transfers(limit=10, offset=0, seed_id=seed, outcome="success").total == 1
        assert svc.live_leases(time.time()) == 1
    finally:
        svc.close()
