"""Transport reports quarantine a seed only on corroboration from distinct witnesses (credentials), or
when the planner's own health probe of the seed fails; a later successful probe clears a quarantine. Real
planner server, the seed (with an HTTP health endpoint) in its own process, SQLite and PostgreSQL."""

from __future__ import annotations

import re
import socket

import pytest

from planner.contract import PlannerClient
from tests.planner.conftest import identity, ranks
from tests.planner.trust_fleet import (
    admin,
    fleet_json,
    instance_loader,
    metrics_text,
    planner,
    seed_process,
    wait_until,
)


def _fail(loader: PlannerClient, seed_id: str, requester_id: str | None = None) -> bool:
    lease = loader.request_assignment(identity=identity(), rank=0, requester_id=requester_id)
    assert lease is not None
    assert lease.candidates[0].instance_id == seed_id
    return loader.report_transfer(
        lease.id, outcome="failure", reason="transport", error="claimed"
    ).seed_quarantined


def test_one_load_token_cannot_quarantine_a_healthy_seed(planner_url):
    """On main three transport reports from one token quarantined a healthy seed for 300 s, in
    milliseconds. Now they only ask for a probe, which the seed passes."""
    with (
        planner(planner_url, probe_interval_s=0.5) as srv,
        seed_process(srv.url, SEED_CONTROL="1") as seed_id,
    ):
        token = PlannerClient(srv.url, token="lr")
        for n in range(6):  # the caller may even name itself differently each time: one token, one witness
            assert not _fail(token, seed_id, requester_id=f"r{n}")
        wait_until(lambda: admin(srv).get_instance(seed_id).quarantined_until is None)
        assert token.request_assignment(identity=identity(), rank=0) is not None


def _other_credential_loader(srv) -> PlannerClient:
    """A loader registered by a second load+register credential ("lr2": the planner's instance_token)."""
    client = PlannerClient(srv.url, token="lr2")
    client.use_token(client.register_instance(identity=identity(), ranks=ranks(0)).token)
    return client


@pytest.mark.slow  # a seed process and the planner's probe: ~8 s
def test_instances_of_one_credential_are_one_witness(planner_url):
    """On main two instances registered by the one load+register token every hook holds were two
    witnesses: their reports quarantined a healthy seed for quarantine_s. Now they only ask for a
    probe, which the seed passes."""
    with (
        planner(planner_url, failure_threshold=2, probe_interval_s=0.5, quarantine_s=3600) as srv,
        seed_process(srv.url, SEED_CONTROL="1") as seed_id,
    ):
        a, _ = instance_loader(srv)
        b, _ = instance_loader(srv)
        for loader in (a, b, a, b):
            assert not _fail(loader, seed_id)
        wait_until(lambda: admin(srv).get_instance(seed_id).quarantined_until is None)
        assert a.request_assignment(identity=identity(), rank=0) is not None


def test_distinct_credentials_corroborate(planner_url):
    with (
        planner(
            planner_url, failure_threshold=2, probe_interval_s=3600, quarantine_s=3600, instance_token="lr2"
        ) as srv,
        seed_process(srv.url, SEED_CONTROL="1") as seed_id,
    ):
        a, _ = instance_loader(srv)
        b = _other_credential_loader(srv)
        assert not _fail(a, seed_id)
        assert _fail(b, seed_id)  # a second credential corroborates: quarantined
        seed = next(i for i in fleet_json(srv)["instances"] if i["id"] == seed_id)
        assert "distinct reporters" in seed["quarantine_reason"]
        assert re.search(
            r'^rfork_planner_quarantined_seeds\{cause="reports"\} 1\.0$', metrics_text(srv), re.M
        )
        assert a.request_assignment(identity=identity(), rank=0) is None


def test_a_healthy_probe_clears_a_quarantine(planner_url):
    """On main a quarantine lasted quarantine_s (here an hour) whatever the seed's health."""
    with (
        planner(
            planner_url, failure_threshold=2, probe_interval_s=0.5, quarantine_s=3600, instance_token="lr2"
        ) as srv,
        seed_process(srv.url, SEED_CONTROL="1") as seed_id,
    ):
        a, _ = instance_loader(srv)
        b = _other_credential_loader(srv)
        assert not _fail(a, seed_id)
        assert _fail(b, seed_id)
        # the seed's control endpoint answers: the next probe clears it, long before quarantine_s
        wait_until(lambda: admin(srv).get_instance(seed_id).quarantined_until is None, why="probe clears")
        assert a.request_assignment(identity=identity(), rank=0) is not None


def test_a_seed_whose_probe_fails_is_quarantined(planner_url):
    """Uncorroborated reports about a seed whose control endpoint is dead: the probe fails, and the
    quarantine says so (fleet page and metrics)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening: refused
        with (
            planner(planner_url, probe_interval_s=0.5, probe_timeout_s=1.0) as srv,
            seed_process(srv.url, SEED_CONTROL_URL=dead_url) as seed_id,
        ):
            token = PlannerClient(srv.url, token="lr")
            for _ in range(3):
                assert not _fail(token, seed_id)
            wait_until(
                lambda: admin(srv).get_instance(seed_id).quarantined_until is not None, why="probe fails"
            )
            seed = next(i for i in fleet_json(srv)["instances"] if i["id"] == seed_id)
            assert seed["quarantine_reason"] == "failed the planner's health probe"
            assert re.search(
                r'^rfork_planner_quarantined_seeds\{cause="probe"\} 1\.0$', metrics_text(srv), re.M
            )
            assert token.request_assignment(identity=identity(), rank=0) is None
