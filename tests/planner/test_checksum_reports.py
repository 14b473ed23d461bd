"""Checksum reports need evidence: the accused seed's own republication never disproves one; another
loader's verified pull (a probation pull the planner schedules) does. Reporters are keyed per instance
(or per named requester under a shared token), so a disproved claim flags its reporter, not a token's
whole fleet. Real planner server, the accused seed in its own process, SQLite and PostgreSQL."""

from __future__ import annotations

import re

from planner.contract import PlannerClient
from tests.planner.conftest import identity
from tests.planner.trust_fleet import (
    admin,
    fleet_json,
    instance_loader,
    metrics_text,
    planner,
    seed_process,
    wait_until,
)


def _accuse(loader: PlannerClient, seed_id: str) -> None:
    lease = loader.request_assignment(identity=identity(), rank=0)
    assert lease is not None
    assert lease.candidates[0].instance_id == seed_id
    answer = loader.report_transfer(lease.id, outcome="failure", reason="checksum_mismatch", error="claimed")
    assert answer.seed_quarantined


def test_a_lying_seed_cannot_disprove_a_report_by_republishing(planner_url):
    """On main the seed's republication of its (honest) digests cleared the report and counted it as
    disproved against the reporter; three rounds silenced the reporter. Now it stays accused."""
    with planner(planner_url, false_report_threshold=1) as srv, seed_process(srv.url) as seed_id:
        reporter, _ = instance_loader(srv)
        _accuse(reporter, seed_id)
        boss = admin(srv)
        wait_until(lambda: not boss.get_instance(seed_id).reverifying, why="the seed republishes")
        assert boss.get_instance(seed_id).accused
        assert reporter.request_assignment(identity=identity(), rank=0) is None  # never its own verifier
        assert fleet_json(srv)["flagged_reporters"] == []
        assert re.search(r"^rfork_planner_flagged_reporters 0\.0$", metrics_text(srv), re.M)
        assert re.search(
            r'^rfork_planner_quarantined_seeds\{cause="accused"\} 1\.0$', metrics_text(srv), re.M
        )
        seed = next(i for i in fleet_json(srv)["instances"] if i["id"] == seed_id)
        assert seed["accused"]
        assert "probation" in seed["quarantine_reason"]


def test_a_verified_pull_by_another_loader_disproves_the_claim_and_flags_its_reporter(planner_url):
    with planner(planner_url, false_report_threshold=1) as srv, seed_process(srv.url) as seed_id:
        liar, liar_id = instance_loader(srv)
        _accuse(liar, seed_id)
        boss = admin(srv)
        wait_until(lambda: not boss.get_instance(seed_id).reverifying, why="the seed republishes")
        verifier, _ = instance_loader(srv)
        probation = verifier.request_assignment(identity=identity(), rank=0)
        assert probation is not None
        assert probation.candidates[0].instance_id == seed_id
        verifier.report_transfer(probation.id, outcome="success", bytes=64, seconds=0.01, backend="tcp")
        assert not boss.get_instance(seed_id).accused  # back in service
        flagged = fleet_json(srv)["flagged_reporters"]
        assert flagged == [{"reporter": f"instance:{liar_id}", "disproved": 1}]
        text = metrics_text(srv)
        assert re.search(r"^rfork_planner_flagged_reporters 1\.0$", text, re.M)
        assert f'rfork_planner_reporter_disproved_claims{{reporter="instance:{liar_id}"}} 1.0' in text
        # the flagged liar's next claim is ignored; an unflagged loader's still counts
        lease = liar.request_assignment(identity=identity(), rank=0)
        assert lease is not None
        ignored = liar.report_transfer(lease.id, outcome="failure", reason="checksum_mismatch")
        assert not ignored.seed_quarantined
        assert not boss.get_instance(seed_id).accused
        _accuse(verifier, seed_id)
        assert boss.get_instance(seed_id).accused


def test_one_caller_of_a_shared_load_token_cannot_silence_the_others(planner_url):
    """Loaders sharing the static load token name themselves (requester_id): a disproved claim flags
    the caller that made it. On main it flagged the token, and every loader's reports were ignored."""
    with planner(planner_url, false_report_threshold=1) as srv, seed_process(srv.url) as seed_id:
        shared = PlannerClient(srv.url, token="lr")
        boss = admin(srv)
        lease = shared.request_assignment(identity=identity(), rank=0, requester_id="liar")
        assert lease is not None
        shared.report_transfer(lease.id, outcome="failure", reason="checksum_mismatch")
        wait_until(lambda: not boss.get_instance(seed_id).reverifying, why="the seed republishes")
        probation = shared.request_assignment(identity=identity(), rank=0, requester_id="verifier")
        assert probation is not None
        assert probation.candidates[0].instance_id == seed_id
        shared.report_transfer(probation.id, outcome="success", bytes=64, seconds=0.01, backend="tcp")
        assert [f["reporter"].split("/")[-1] for f in fleet_json(srv)["flagged_reporters"]] == ["liar"]
        honest = shared.request_assignment(identity=identity(), rank=0, requester_id="honest")
        assert honest is not None
        answer = shared.report_transfer(honest.id, outcome="failure", reason="checksum_mismatch")
        assert answer.seed_quarantined  # counted: the token is not silenced
        assert boss.get_instance(seed_id).reverifying
