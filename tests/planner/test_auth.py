"""Bearer tokens with least privilege: admin, register, load, reader and per-instance tokens; leases bound
to their requester; auth and body limits before the body is read; refusing to start without tokens."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
import pytest

from planner.app import InsecureRefused, create_app
from planner.contract import AuthError, Conflict, PlannerClient, RankManifest
from planner.server import PlannerServer
from planner.settings import PlannerSettings
from tests.planner.conftest import identity, manifest, ranks

TOKENS: dict[str, Any] = {
    "admin_token": "adm-secret",
    "register_token": "reg-secret",
    "anchor_token": "anc-secret",
    "load_token": "load-secret",
    "reader_token": "read-secret",
}


@pytest.fixture
def secure(planner_url):
    with PlannerServer(db_url=planner_url, port=0, insecure=False, reaper_interval_s=3600, **TOKENS) as srv:
        yield srv


def test_unknown_tokens_are_refused(secure):
    with pytest.raises(AuthError):
        PlannerClient(secure.url).list_instances()
    with pytest.raises(AuthError):
        PlannerClient(secure.url, token="wrong").list_instances()
    with pytest.raises(AuthError):
        PlannerClient(secure.url, token="rfi_wrong").list_instances()


def test_least_privilege_roles(secure):
    register = PlannerClient(secure.url, token="reg-secret")
    # a: a trusted disk seed (the anchor role registers too, and its disk publication anchors)
    a = PlannerClient(secure.url, token="anc-secret").register_instance(identity=identity(), ranks=ranks(0))
    b = register.register_instance(identity=identity(), ranks=ranks(0))
    with pytest.raises(AuthError):  # the register token changes no instance ...
        register.set_status(a.id, "READY")
    with pytest.raises(AuthError):  # ... and requests no assignment
        register.request_assignment(identity=identity(), rank=0)

    own = PlannerClient(secure.url, token=a.token)
    own.put_manifest(a.id, 0, manifest(0))
    own.set_status(a.id, "READY")
    own.heartbeat(a.id)
    with pytest.raises(AuthError):
        own.set_status(b.id, "READY")
    with pytest.raises(AuthError):
        own.heartbeat(b.id)
    with pytest.raises(AuthError):
        own.delete_instance(b.id)
    with pytest.raises(AuthError):  # an instance token registers nothing
        own.register_instance(identity=identity())
    with pytest.raises(AuthError):  # may not pretend to be another requester
        own.request_assignment(identity=identity(), rank=0, requester_id=b.id)

    load = PlannerClient(secure.url, token="load-secret")
    with pytest.raises(AuthError):  # the load token registers nothing and changes no instance
        load.register_instance(identity=identity())
    with pytest.raises(AuthError):
        load.heartbeat(a.id)
    lease = load.request_assignment(identity=identity(), rank=0)
    assert lease is not None
    assert lease.candidates[0].rank_manifest().regions[0].descriptor  # a loader needs the keys

    reader = PlannerClient(secure.url, token="read-secret")
    with pytest.raises(AuthError):
        reader.request_assignment(identity=identity(), rank=0)
    for other in (own, register, reader):  # only the lease's requester reports on it
        with pytest.raises(AuthError):
            other.report_transfer(lease.id, outcome="failure")
    load.report_transfer(lease.id, outcome="success", bytes=1, seconds=1.0)
    with pytest.raises(Conflict):  # an ended lease takes no more reports
        load.report_transfer(lease.id, outcome="failure")

    as_b = PlannerClient(secure.url, token=b.token)
    with pytest.raises(AuthError):  # registered by a register-only token: register never implies load
        as_b.request_assignment(identity=identity(), rank=0)
    admin_lease = PlannerClient(secure.url, token="adm-secret").request_assignment(
        identity=identity(), rank=0
    )
    assert admin_lease is not None
    with pytest.raises(AuthError):  # the load token did not request this one
        load.report_transfer(admin_lease.id, outcome="failure")
    PlannerClient(secure.url, token="adm-secret").report_transfer(admin_lease.id, outcome="success")

    # readers (and other instances) see manifests without descriptors; the owner and admins with them
    assert reader.get_manifest(a.id, 0).regions[0].descriptor == ""
    assert [t.model_dump() for t in reader.get_manifest(a.id, 0).tensors] == manifest(0)["tensors"]
    assert as_b.get_manifest(a.id, 0).regions[0].descriptor == ""
    assert own.get_manifest(a.id, 0) == RankManifest.model_validate(manifest(0))
    admin = PlannerClient(secure.url, token="adm-secret")
    assert admin.get_manifest(a.id, 0) == RankManifest.model_validate(manifest(0))
    assert reader.list_instances().total == 2
    assert reader.transfers().total == 2
    with pytest.raises(AuthError):
        reader.heartbeat(a.id)
    with pytest.raises(AuthError):
        reader.register_instance(identity=identity())

    admin.set_status(b.id, "READY")
    own.delete_instance(a.id)
    with pytest.raises(AuthError):  # a deleted instance's token is dead
        own.heartbeat(a.id)
    assert httpx.get(secure.url + "/healthz").status_code == 200
    assert httpx.get(secure.url + "/metrics").status_code == 200


def test_one_token_may_hold_several_roles(planner_url):
    """A loader that becomes a seed: the same string configured as load and register token."""
    with PlannerServer(
        db_url=planner_url, port=0, reaper_interval_s=3600, load_token="both", register_token="both"
    ) as srv:
        both = PlannerClient(srv.url, token="both")
        reg = both.register_instance(identity=identity(), ranks=ranks(0))
        assert both.request_assignment(identity=identity(), rank=0) is None
        with pytest.raises(AuthError):
            both.set_status(reg.id, "READY")


def test_legacy_instance_token_registers_and_loads(planner_url):
    with PlannerServer(db_url=planner_url, port=0, reaper_interval_s=3600, instance_token="old") as srv:
        old = PlannerClient(srv.url, token="old")
        old.register_instance(identity=identity(), ranks=ranks(0))
        assert old.request_assignment(identity=identity(), rank=0) is None


def test_auth_runs_before_the_body_is_read(secure):
    """An anonymous large body is answered 401 (not 422) and is not buffered; an oversized one 413."""
    junk = b"x" * (3 << 20)  # under the 4 MiB body limit: only auth can refuse it
    r = httpx.post(secure.url + "/v1/instances", content=junk, headers={"content-type": "application/json"})
    assert r.status_code == 401
    r = httpx.post(
        secure.url + "/v1/instances",
        content=b"x" * (5 << 20),
        headers={"content-type": "application/json", "authorization": "Bearer adm-secret"},
    )
    assert r.status_code == 413
    assert "limit" in r.json()["detail"]

    def chunks():
        for _ in range(6):
            yield b"x" * (1 << 20)

    r = httpx.post(  # no Content-Length (chunked): counted as it arrives, refused past the limit
        secure.url + "/v1/assignments",
        content=chunks(),
        headers={"content-type": "application/json", "authorization": "Bearer load-secret"},
    )
    assert r.status_code == 413


def test_refuses_to_start_without_tokens(sqlite_url):
    with pytest.raises(InsecureRefused, match="--insecure"):
        create_app(PlannerSettings(db_url=sqlite_url))
    proc = subprocess.run(
        [sys.executable, "-m", "rfork", "planner", "serve", "--db", sqlite_url, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": "."},
    )
    assert proc.returncode != 0
    assert "--insecure" in proc.stderr


def test_insecure_logs_a_warning(sqlite_url, caplog):
    with caplog.at_level("WARNING"), PlannerServer(db_url=sqlite_url, port=0, insecure=True):
        pass
    assert any("WITHOUT authentication" in r.getMessage() for r in caplog.records)
