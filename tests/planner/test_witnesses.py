"""Witnesses that cost something: the instances one credential registers are one witness, registrations
per credential are bounded, and an accusation no probation pull ended lapses. Real planner server
(the in-process ASGI app on a real socket) or the service with moved time, SQLite and PostgreSQL."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from planner import NoSource, TransferReport
from planner.contract import Conflict, PlannerClient
from planner.service.reaper import reap
from tests.planner.conftest import identity, make_planner, manifest, ranks
from tests.planner.test_fleet_safety import _ask, _ready_seed
from tests.planner.trust_fleet import admin, instance_loader, planner


def _seed(srv: Any) -> tuple[PlannerClient, str]:
    """A READY seed registered with the anchor role (its manifest anchors the identity), and its client."""
    anchor = PlannerClient(srv.url, token="anc")
    reg = anchor.register_instance(identity=identity(), ranks=ranks(0))
    own = anchor.with_token(reg.token)
    own.put_manifest(reg.id, 0, manifest(0))
    own.set_status(reg.id, "READY")
    return own, str(reg.id)


def _accuse(loader: PlannerClient, seed: PlannerClient, seed_id: str) -> None:
    """A checksum claim against the seed, then the seed's clean re-hash (what its heartbeat asks for)."""
    lease = loader.request_assignment(identity=identity(), rank=0)
    assert lease is not None
    assert lease.candidates[0].instance_id == seed_id
    loader.report_transfer(lease.id, outcome="failure", reason="checksum_mismatch", error="claimed")
    seed.put_manifest(seed_id, 0, manifest(0))


def test_instances_of_one_credential_are_one_checksum_witness(planner_url: str) -> None:
    """The attack: the load+register token every hook holds registers two instances of the victim's
    identity, and each accuses the honest seed (the second through the probation pull the planner gives
    it). On main they were two witnesses: no more probation, the seed out of service until it restarted.
    Now they are one credential: the next loader's probation pull verifies it and it serves again."""
    with planner(planner_url) as srv:
        seed, seed_id = _seed(srv)
        first, _ = instance_loader(srv)
        second, _ = instance_loader(srv)
        _accuse(first, seed, seed_id)
        _accuse(second, seed, seed_id)  # a probation pull, accused again
        assert admin(srv).get_instance(seed_id).accused
        honest, _ = instance_loader(srv)
        probation = honest.request_assignment(identity=identity(), rank=0)
        assert probation is not None
        assert probation.candidates[0].instance_id == seed_id
        honest.report_transfer(probation.id, outcome="success", bytes=64, seconds=0.01, backend="tcp")
        assert not admin(srv).get_instance(seed_id).accused


def test_distinct_credentials_still_corroborate_a_checksum_claim(planner_url: str) -> None:
    with planner(planner_url, instance_token="lr2") as srv:
        seed, seed_id = _seed(srv)
        first, _ = instance_loader(srv)
        other = PlannerClient(srv.url, token="lr2")
        other.use_token(other.register_instance(identity=identity(), ranks=ranks(0)).token)
        _accuse(first, seed, seed_id)
        _accuse(other, seed, seed_id)
        honest, _ = instance_loader(srv)
        assert honest.request_assignment(identity=identity(), rank=0) is None  # no probation: corroborated


def test_registrations_per_credential_are_bounded(planner_url: str) -> None:
    with planner(planner_url, max_instances_per_credential=2) as srv:
        shared = PlannerClient(srv.url, token="lr")
        first = shared.register_instance(identity=identity(), ranks=ranks(0))
        shared.register_instance(identity=identity(fingerprint="other"), ranks=ranks(0))
        with pytest.raises(Conflict, match="max_instances_per_credential = 2") as refused:
            shared.register_instance(identity=identity(), ranks=ranks(0))
        assert (refused.value.status, refused.value.reason) == (409, "registration_limit")
        PlannerClient(srv.url, token="anc").register_instance(identity=identity(), ranks=ranks(0))
        admin(srv).register_instance(identity=identity(), ranks=ranks(0))  # an admin's are not counted
        shared.with_token(first.token).delete_instance(first.id)
        shared.register_instance(identity=identity(), ranks=ranks(0))  # a slot was freed


def test_an_accusation_no_probation_ended_lapses(planner_url: str) -> None:
    """Claims from two credentials end the probation pulls; the accusation still lapses after
    accusation_s (the reaper), so the seed is not out of service until it restarts."""
    svc = make_planner(planner_url, accusation_s=600)
    try:
        now = time.time()
        seed = _ready_seed(svc, now)
        for n, who in enumerate(("token:a", "token:b")):
            lease = svc.assign(_ask(requester_id=who), now + n, holder=who, credential=who)
            assert lease.candidates[0].instance_id == seed
            svc.report(lease.id, TransferReport(outcome="failure", reason="checksum_mismatch"), now + n, who)
            svc.put_manifest(seed, 0, json.dumps(manifest(0)), now + n)
        with pytest.raises(NoSource):
            svc.assign(_ask(requester_id="c"), now + 2, holder="token:c")
        svc.heartbeat(seed, now + 300)
        assert reap(svc.db, svc.settings, now + 300).lapsed == 0
        svc.heartbeat(seed, now + 601)
        assert reap(svc.db, svc.settings, now + 601).lapsed == 1
        back = svc.assign(_ask(requester_id="c"), now + 601, holder="token:c")
        assert back.candidates[0].instance_id == seed
    finally:
        svc.close()
