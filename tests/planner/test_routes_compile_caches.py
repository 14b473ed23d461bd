"""/v1/compile-caches: which READY instances serve a compile-cache key, with compile-cache-only tokens."""

from __future__ import annotations

import time

import pytest

from planner.contract import AuthError, BadRequest, Conflict, PlannerClient, control_token
from planner.server import PlannerServer
from tests.planner.conftest import identity, ranks
from tests.planner.test_auth import TOKENS

KEY, OTHER = "a" * 64, "b" * 64


def _serving(c: PlannerClient, *, node: str, ident: dict | None = None, keys: tuple[str, ...] = (KEY,)):
    key = control_token.new_control_key()
    reg = c.register_instance(
        identity=ident or identity(),
        labels={"node": node},
        ranks=ranks(0),
        control_url=f"http://{node}:9",
        control_key=key,
        compile_cache_keys=keys,
    )
    return reg, key


def test_ready_instances_serving_a_key_come_with_a_compile_cache_token(server):
    c = PlannerClient(server.url)
    far, far_key = _serving(c, node="n2")
    near, near_key = _serving(c, node="n1")
    assert near.compile_cache_keys == [KEY]
    assert c.compile_cache_sources(KEY) is None  # INITIALIZING: not yet
    c.set_status(far.id, "READY")
    c.set_status(near.id, "READY")
    found = c.compile_cache_sources(KEY, labels={"node": "n1"})
    assert found is not None
    assert [s.instance_id for s in found.sources] == [near.id, far.id]  # same node first
    assert found.sources[0].control_url == "http://n1:9"
    grant = control_token.verify_control_token(
        found.sources[0].control_token, near_key, instance_ids=[near.id], rank=0, now=time.time()
    )
    assert grant.compile_cache  # never a weight lease: the seed opens no NCCL session with it
    assert "control_token" not in repr(found.sources[0])
    assert c.compile_cache_sources(OTHER) is None
    c.delete_instance(near.id)
    found = c.compile_cache_sources(KEY)
    assert found is not None
    assert [s.instance_id for s in found.sources] == [far.id]
    c.set_status(far.id, "DRAINING")
    assert c.compile_cache_sources(KEY) is None


def test_registration_with_keys_needs_a_control_endpoint_and_valid_keys(server):
    c = PlannerClient(server.url)
    with pytest.raises(Conflict, match="control_url"):
        c.register_instance(identity=identity(), ranks=ranks(0), compile_cache_keys=[KEY])
    with pytest.raises(BadRequest, match="compile_cache_keys"):
        c.register_instance(identity=identity(), ranks=ranks(0), compile_cache_keys=["../etc"])
    with pytest.raises(Conflict, match="twice"):
        _serving(c, node="n1", keys=(KEY, KEY))


def test_an_instance_token_sees_only_its_own_identity(planner_url):
    tokens = {**TOKENS, "instance_token": "reg-load-secret"}  # register + load: its instances may lease
    with PlannerServer(db_url=planner_url, port=0, insecure=False, reaper_interval_s=3600, **tokens) as srv:
        reg = PlannerClient(srv.url, token="reg-load-secret")
        mine, _ = _serving(reg, node="n1")
        PlannerClient(srv.url, token=mine.token).set_status(mine.id, "READY")
        other = reg.register_instance(identity=identity(fingerprint="other"), ranks=ranks(0))
        assert PlannerClient(srv.url, token="load-secret").compile_cache_sources(KEY) is not None
        assert PlannerClient(srv.url, token=other.token).compile_cache_sources(KEY) is None
        assert PlannerClient(srv.url, token=mine.token).compile_cache_sources(KEY) is not None
        with pytest.raises(AuthError):
            PlannerClient(srv.url, token="read-secret").compile_cache_sources(KEY)
