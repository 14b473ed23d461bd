"""Malformed, oversized and out-of-range requests get a 4xx naming the field, never a 500."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from planner.server import PlannerServer
from tests.planner.conftest import identity, manifest


def _post(url: str, path: str, body: object) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=10)


def test_named_fields(server):
    url = server.url
    r = _post(url, "/v1/instances", {"identity": identity(tp=0)})
    assert r.status_code == 422
    assert "tp" in r.text
    r = _post(url, "/v1/instances", {"identity": identity(), "max_concurrent_pulls": 10**12})
    assert r.status_code == 422
    assert "max_concurrent_pulls" in r.text
    r = _post(url, "/v1/instances", {"identity": identity(model="a\x00b")})
    assert r.status_code == 422
    assert "model" in r.text
    r = _post(
        url,
        "/v1/instances",
        {"identity": identity(), "ranks": [{"rank": 0, "provider": "tcp", "address": "***"}]},
    )
    assert r.status_code == 422
    assert "address" in r.text
    r = _post(
        url,
        "/v1/instances",
        {"identity": identity(), "ranks": [{"rank": 9, "provider": "tcp", "address": ""}]},
    )
    assert r.status_code == 422
    assert "rank" in r.text
    r = httpx.post(url + "/v1/instances", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    r = _post(url, "/v1/assignments", {"identity": identity(), "rank": -1})
    assert r.status_code == 422
    assert "rank" in r.text
    r = _post(url, "/v1/assignments/" + "a" * 32 + "/report", {"outcome": "success", "seconds": "NaN"})
    assert r.status_code == 422
    assert "seconds" in r.text
    assert httpx.get(url + "/v1/instances/xyz").status_code == 422
    assert httpx.get(url + "/v1/instances?limit=0").status_code == 422


def test_manifest_size_limit(planner_url):
    with PlannerServer(db_url=planner_url, port=0, insecure=True, max_manifest_bytes=4096) as srv:
        reg = httpx.post(srv.url + "/v1/instances", json={"identity": identity()}).json()
        big = manifest(0)
        big["tensors"] = big["tensors"] * 200
        r = httpx.put(f"{srv.url}/v1/instances/{reg['id']}/manifests/0", json=big)
        assert r.status_code == 413
        assert "limit" in r.text
        r = httpx.put(f"{srv.url}/v1/instances/{reg['id']}/manifests/0", content=b"\xff\xfe")
        assert r.status_code in (400, 422)


def _patch_hypothesis_jsonschema(monkeypatch) -> None:
    """hypothesis-jsonschema calls `many.more()`, which newer hypothesis replaced by iteration; adapt it."""
    import types

    from hypothesis.internal.conjecture import utils as cu
    from hypothesis_jsonschema import _from_schema

    if hasattr(cu.many, "more"):
        return

    class _Many(cu.many):
        _it = None

        def more(self) -> bool:
            if self._it is None:
                self.__enter__()
                self._it = iter(self)
            try:
                next(self._it)
            except StopIteration:
                self.__exit__(None)
                return False
            return True

    shim = types.SimpleNamespace(**{k: getattr(cu, k) for k in dir(cu) if not k.startswith("__")})
    shim.many = _Many
    monkeypatch.setattr(_from_schema, "cu", shim)


def test_schemathesis_finds_no_500(sqlite_url, monkeypatch):
    schemathesis = pytest.importorskip("schemathesis")
    _patch_hypothesis_jsonschema(monkeypatch)
    from planner.app import create_app
    from planner.db import migrate
    from planner.settings import PlannerSettings

    migrate(sqlite_url)
    app = create_app(PlannerSettings(db_url=sqlite_url, insecure=True), run_reaper=False)
    schemathesis.experimental.OPEN_API_3_1.enable()
    schema = schemathesis.from_asgi("/openapi.json", app)
    failures: list[str] = []
    calls: list[int] = []
    for result in schema.get_all_operations():
        _explore(result.ok(), failures, calls)
    assert failures == []
    assert len(calls) > 100


def _explore(operation, failures: list[str], calls: list[int]) -> None:
    @settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy())
    def check(case):
        response = case.call_asgi()
        calls.append(response.status_code)
        if response.status_code >= 500:
            failures.append(f"{operation.verbose_name}: {response.status_code} {response.text[:300]}")

    check()
