"""Instances through the client: register, get, list, status transitions, heartbeat, manifests, delete."""

from __future__ import annotations

import httpx
import pytest

from planner.contract import BadRequest, Conflict, NotFound, PlannerClient, RankManifest
from tests.planner.conftest import identity, manifest, ranks


def test_register_get_list_delete(server):
    c = PlannerClient(server.url)
    reg = c.register_instance(
        identity=identity(),
        labels={"node": "n1", "rack": "r1", "zone": "z"},
        control_url="http://seed:1",
        ranks=ranks(0, 1),
        max_concurrent_pulls=3,
    )
    assert reg.status == "INITIALIZING"
    assert reg.token.startswith("rfi_")
    assert len(reg.identity_key) == 64
    got = c.get_instance(reg.id)
    assert got.labels.model_dump() == {"node": "n1", "rack": "r1", "zone": "z"}
    assert [r.rank for r in got.ranks] == [0, 1]
    assert got.max_concurrent_pulls == 3
    other = c.register_instance(identity=identity(model="other", fingerprint="fp2"), labels={"node": "n2"})
    assert c.list_instances().total == 2
    assert [i.id for i in c.list_instances(model="other").items] == [other.id]
    assert [i.id for i in c.list_instances(fingerprint="fp1").items] == [reg.id]
    assert [i.id for i in c.list_instances(node="n2").items] == [other.id]
    page = c.list_instances(limit=1, offset=1)
    assert page.total == 2
    assert len(page.items) == 1
    c.delete_instance(reg.id)
    with pytest.raises(NotFound):
        c.get_instance(reg.id)
    with pytest.raises(NotFound):
        c.delete_instance(reg.id)


def test_status_transitions(server):
    c = PlannerClient(server.url)
    a = c.register_instance(identity=identity()).id
    c.set_status(a, "LOADING")
    with pytest.raises(Conflict, match="LOADING -> INITIALIZING"):
        c.set_status(a, "INITIALIZING")
    c.set_status(a, "READY")
    with pytest.raises(Conflict):
        c.set_status(a, "LOADING")
    c.set_status(a, "DRAINING")
    with pytest.raises(Conflict):
        c.set_status(a, "READY")
    b = c.register_instance(identity=identity()).id
    assert c.set_status(b, "READY").status == "READY"  # seed loaded from disk
    d = c.register_instance(identity=identity()).id
    assert c.set_status(d, "DRAINING").status == "DRAINING"
    with pytest.raises(BadRequest, match="status"):  # the client refuses it before sending ...
        c.set_status(d, "STALE")
    refused = httpx.post(f"{c.base_url}/v1/instances/{d}/status", json={"status": "STALE"})
    assert refused.status_code == 422  # ... and so does the planner: only the reaper sets STALE
    assert c.list_instances(status="DRAINING").total == 2


def test_heartbeat(server):
    c = PlannerClient(server.url)
    a = c.register_instance(identity=identity()).id
    hb = c.heartbeat(a)
    assert hb.status == "INITIALIZING"
    assert hb.ttl_s > 0
    with pytest.raises(NotFound):
        c.heartbeat("0" * 32)


def test_manifests(server):
    c = PlannerClient(server.url)
    a = c.register_instance(identity=identity(), ranks=ranks(0, 1)).id
    c.put_manifest(a, 1, manifest(1))
    assert c.get_manifest(a, 1) == RankManifest.model_validate(manifest(1))
    updated = manifest(1) | {"checksum_algorithm": "sha256"}
    c.put_manifest(a, 1, updated)
    assert c.get_manifest(a, 1).checksum_algorithm == "sha256"
    with pytest.raises(NotFound):
        c.get_manifest(a, 0)
    with pytest.raises(Conflict, match="rank"):  # well-formed, but contradicts the path: 409
        c.put_manifest(a, 0, manifest(1))
    with pytest.raises(Conflict, match="tp\\*pp"):
        c.put_manifest(a, 5, manifest(5))
    bad = manifest(0)
    bad["tensors"][0]["region"] = 7
    with pytest.raises(Conflict, match="region"):  # JSON Schema cannot say it: 409, not 422
        c.put_manifest(a, 0, bad)
    bad = manifest(0)
    del bad["regions"][0]["nbytes"]
    with pytest.raises(BadRequest, match="nbytes"):
        c.put_manifest(a, 0, bad)
