"""Bearer tokens: admin, instance (generic and per-instance), reader; refusing to start without tokens."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
import pytest

from planner.app import InsecureRefused, create_app
from planner.client import AuthError, PlannerClient
from planner.server import PlannerServer
from planner.settings import PlannerSettings
from tests.planner.conftest import identity, manifest, ranks

TOKENS: dict[str, Any] = {
    "admin_token": "adm-secret", "instance_token": "inst-secret", "reader_token": "read-secret"
}


@pytest.fixture
def secure(planner_url):
    with PlannerServer(db_url=planner_url, port=0, insecure=False, reaper_interval_s=3600, **TOKENS) as srv:
        yield srv


def test_roles(secure):
    anon = PlannerClient(secure.url)
    with pytest.raises(AuthError):
        anon.list_instances()
    with pytest.raises(AuthError):
        PlannerClient(secure.url, token="wrong").list_instances()
    with pytest.raises(AuthError):
        PlannerClient(secure.url, token="rfi_wrong").list_instances()

    inst = PlannerClient(secure.url, token="inst-secret")
    a = inst.register_instance(identity=identity(), ranks=ranks(0))
    b = inst.register_instance(identity=identity(), ranks=ranks(0))
    with pytest.raises(AuthError):  # the generic instance token changes no instance
        inst.set_status(a.id, "READY")
    assert inst.request_assignment(identity=identity(), rank=0) is None

    own = PlannerClient(secure.url)
    own.use_token(a.token)
    own.put_manifest(a.id, 0, manifest(0))
    own.set_status(a.id, "READY")
    own.heartbeat(a.id)
    with pytest.raises(AuthError):
        own.set_status(b.id, "READY")
    with pytest.raises(AuthError):
        own.heartbeat(b.id)
    with pytest.raises(AuthError):
        own.delete_instance(b.id)
    with pytest.raises(AuthError):  # may not pretend to be another requester
        own.request_assignment(identity=identity(), rank=0, requester_id=b.id)

    loader = PlannerClient(secure.url, token=b.token)
    lease = loader.request_assignment(identity=identity(), rank=0, requester_id=b.id)
    assert lease is not None
    with pytest.raises(AuthError):  # the lease is b's, not a's
        own.report_transfer(lease.id, outcome="success")
    loader.report_transfer(lease.id, outcome="success", bytes=1, seconds=1.0)

    reader = PlannerClient(secure.url, token="read-secret")
    assert reader.list_instances()["total"] == 2
    assert reader.get_manifest(a.id, 0) == manifest(0)
    assert reader.transfers()["total"] == 1
    with pytest.raises(AuthError):
        reader.heartbeat(a.id)
    with pytest.raises(AuthError):
        reader.register_instance(identity=identity())

    admin = PlannerClient(secure.url, token="adm-secret")
    admin.set_status(b.id, "READY")
    own.delete_instance(a.id)
    with pytest.raises(AuthError):  # a deleted instance's token is dead
        own.heartbeat(a.id)
    assert httpx.get(secure.url + "/healthz").status_code == 200
    assert httpx.get(secure.url + "/metrics").status_code == 200


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
