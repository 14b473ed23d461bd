"""Malformed, oversized and out-of-range requests get a 4xx naming the field, never a 500."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from planner import AssignmentRequest, PlannerServer, RankManifest, RegistrationRequest
from planner.contract.wire import (
    CompileCacheAnchorUpload,
    CompileCacheReport,
    CompileCacheRequest,
    compile_cache_key,
    identity_key,
)
from tests.planner.conftest import empty_database, identity, manifest, ranks


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
    assert r.status_code == 409  # well-formed, but contradicts tp*pp: JSON Schema cannot say so
    assert "rank" in r.text
    flag_rank = {"rank": True, "provider": "t", "address": ""}
    r = _post(url, "/v1/instances", {"identity": identity(), "ranks": [flag_rank]})
    assert r.status_code == 422  # a boolean is not a JSON integer
    r = _post(url, "/v1/instances", {"identity": identity(tp=2.0), "max_concurrent_pulls": "3"})
    assert r.status_code == 422  # 2.0 is an integer; "3" is not
    assert "max_concurrent_pulls" in r.text
    assert "tp" not in r.json()["message"]
    r = httpx.post(url + "/v1/instances", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code in (400, 422)  # both documented
    r = _post(url, "/v1/assignments", {"identity": identity(), "rank": -1})
    assert r.status_code == 422
    assert "rank" in r.text
    r = _post(url, "/v1/assignments/" + "a" * 32 + "/report", {"outcome": "success", "seconds": "NaN"})
    assert r.status_code == 422
    assert "seconds" in r.text
    assert httpx.get(url + "/v1/instances/xyz").status_code == 422
    assert httpx.get(url + "/v1/instances?limit=0").status_code == 422


@pytest.mark.parametrize(
    "url",
    [
        "ftp://seed:1",
        "http://0.0.0.0:8000",
        "http://user:pw@seed:1",
        "http://seed:1/x?y",
        "http://seed:99999",
        "javascript:alert(1)",
        "http://",
    ],
)
def test_control_url_is_validated(peer, url):
    r = peer.http.post("/v1/instances", json={"identity": identity(), "control_url": url})
    assert r.status_code == 422
    assert "control_url" in r.text


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


@pytest.mark.slow
def test_schemathesis_all_checks_with_stateful_links(sqlite_url, tmp_path):
    """schemathesis 4, `--checks all`, every phase (coverage, fuzzing, and the stateful phase that
    follows the OpenAPI links: register -> status/heartbeat/manifest -> delete), against a running
    planner with auth on. Exit status 0 means no check failed."""
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which("schemathesis")
    if exe is None:
        pytest.skip("schemathesis is not installed (pip install -e .[dev])")
    with PlannerServer(db_url=sqlite_url, port=0, admin_token="st-admin", reaper_interval_s=3600) as srv:
        proc = subprocess.run(
            [
                exe,
                "run",
                f"{srv.url}/openapi.json",
                "--checks",
                "all",
                "-H",
                "Authorization: Bearer st-admin",
                "--max-examples",
                "8",
                "--workers",
                "1",
                "--seed",
                "12",
                "--no-color",
                "--generation-database",
                "none",
                "--report-dir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
    out = proc.stdout + proc.stderr
    assert "Stateful" in out, out[-3000:]
    assert proc.returncode == 0, out[-6000:]


# ---- properties: whatever a peer sends, the answer is the wire type's verdict, never a 500 ----------

# values a peer might put anywhere, weighted towards what breaks databases and parsers
EDGE_INTS = st.sampled_from([-1, 0, 1, 2**31, 2**53, 2**53 + 1, 2**63, 2**64])
EDGE_TEXT = st.sampled_from(["", "\x00", "a\x00b", "x" * 5000, "é" * 300, "🦀" * 200, "tcp"])
SAME_TYPE: dict[type, st.SearchStrategy[Any]] = {
    bool: st.booleans(),
    int: st.integers(-2, 70_000) | EDGE_INTS | st.integers(),
    float: st.floats(allow_nan=False, allow_infinity=False),
    str: st.text(max_size=16) | EDGE_TEXT,
}
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.floats(allow_nan=False, allow_infinity=False)
    | SAME_TYPE[int]
    | SAME_TYPE[str],
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def mutated(draw: st.DrawFn, doc: Any) -> Any:
    """`doc` after one to three edits at random depths: a member dropped, added, replaced by any JSON
    value or by another value of its type (so many edits still pass validation and reach the database);
    a list item dropped, appended or replaced."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):
        node = doc
        while True:
            values = list(node.values()) if isinstance(node, dict) else list(node)
            inner = [v for v in values if isinstance(v, (dict, list)) and v]
            if not inner or draw(st.booleans()):
                break
            node = draw(st.sampled_from(inner))
        action = draw(st.sampled_from(["drop", "add", "replace", "retype", "retype", "retype", "retype"]))
        if action == "add" or not node:
            if isinstance(node, dict):
                node[draw(st.text(max_size=6))] = draw(JSON_VALUES)
            else:
                node.append(draw(JSON_VALUES))
            continue
        where = draw(
            st.sampled_from(sorted(node)) if isinstance(node, dict) else st.integers(0, len(node) - 1)
        )
        if action == "drop":
            del node[where]
        elif action == "retype" and type(node[where]) in SAME_TYPE:
            node[where] = draw(SAME_TYPE[type(node[where])])
        else:
            node[where] = draw(JSON_VALUES)
    return doc


PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Peer(NamedTuple):
    """A client of the planner the property tests share, and which database that planner runs on."""

    http: httpx.Client
    postgres: bool


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def peer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Peer]:
    """One planner shared by the property tests and the control URL checks of this module (SQLite,
    PostgreSQL): each request is answered on its own, so none needs a planner of its own."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'planner.db'}"
    else:
        url = str(request.getfixturevalue("postgres_url"))
    with (
        PlannerServer(db_url=empty_database(url), port=0, insecure=True, reaper_interval_s=3600) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as client,
    ):
        yield Peer(client, postgres=request.param == "postgres")


def _verdict(model: type[RegistrationRequest] | type[AssignmentRequest], body: Any) -> int | None:
    """422 when `model` refuses `body`, 409 when it contradicts itself, else None."""
    try:
        parsed = model.model_validate_json(json.dumps(body))
    except ValidationError:
        return 422
    if isinstance(parsed, RegistrationRequest) and parsed.conflicts() is not None:
        return 409
    return None


@PROPERTY
@given(data=st.data())
def test_any_registration_is_answered_as_the_wire_type_decides(peer: Peer, data: st.DataObject):
    rank0 = {**ranks(0)[0], "address": "YWRkcjA="}
    valid = {
        "identity": identity(),
        "labels": {"node": "n"},
        "control_url": "http://seed:1",
        "ranks": [rank0],
    }
    body = data.draw(mutated(valid))
    r = peer.http.post("/v1/instances", json=body)
    assert r.status_code == (_verdict(RegistrationRequest, body) or 201), r.text


@PROPERTY
@given(data=st.data())
def test_any_assignment_request_is_answered_as_the_wire_type_decides(peer: Peer, data: st.DataObject):
    valid = {
        "identity": identity(model=uuid.uuid4().hex),
        "rank": 0,
        "providers": ["tcp"],
        "requester_id": "me",
    }
    body = data.draw(mutated(valid))
    r = peer.http.post("/v1/assignments", json=body)
    want = _verdict(AssignmentRequest, body)
    assert r.status_code == (want or 404), r.text  # a valid request for an unknown identity: no source
    if want is None:
        assert r.json()["reason"] == "no_source"


@PROPERTY
@given(data=st.data())
def test_any_manifest_is_answered_as_the_wire_type_decides(peer: Peer, data: st.DataObject):
    # a fresh identity each time, so no anchor from an earlier example takes part
    reg = peer.http.post("/v1/instances", json={"identity": identity(model=uuid.uuid4().hex)})
    assert reg.status_code == 201
    body = data.draw(mutated(manifest(0)))
    r = peer.http.put(f"/v1/instances/{reg.json()['id']}/manifests/0", json=body)
    try:
        parsed = RankManifest.model_validate_json(json.dumps(body))
    except ValidationError:
        want = 422
    else:
        want = 409 if parsed.conflicts() is not None or parsed.rank != 0 else 204
        if want == 204 and peer.postgres and "\x00" in parsed.checksum_algorithm:
            # the wire type lets a NUL through here (SQLite stores it), PostgreSQL's column cannot hold
            # it: the DataError handler answers 422 naming that (left as it was; see docs/planner.md)
            want = 422
            assert r.status_code == want, r.text
            assert "does not fit its column" in r.text
    assert r.status_code == want, r.text
    if want == 204:  # stored verbatim: what was sent comes back
        assert peer.http.get(f"/v1/instances/{reg.json()['id']}/manifests/0").json() == body


@PROPERTY
@given(data=st.data())
def test_any_compile_cache_anchor_is_answered_as_the_wire_type_and_the_key_decide(
    peer: Peer, data: st.DataObject
):
    """An anchor names the key's variant: the planner derives the key from it and the identity, and a
    key that is not the identity's is a 409, whatever else the body holds."""
    ident, variant = identity_key(identity(model=uuid.uuid4().hex)), uuid.uuid4().hex * 2
    key = compile_cache_key(ident, variant)
    valid = {"archive_digest": "sha256:" + "1" * 64, "key_variant": variant, "identity_key": ident}
    body = data.draw(mutated(valid))
    r = peer.http.put(f"/v1/compile-caches/{key}/anchor", json=body)
    try:
        parsed = CompileCacheAnchorUpload.model_validate_json(json.dumps(body))
    except ValidationError:
        want = 422
    else:
        bound = parsed.identity_key is not None and compile_cache_key(parsed.identity_key, parsed.key_variant)
        want = 200 if bound == key else 409
    assert r.status_code == want, r.text


@PROPERTY
@given(data=st.data())
def test_any_compile_cache_report_or_request_is_answered_as_the_wire_type_decides(
    peer: Peer, data: st.DataObject
):
    key = compile_cache_key(identity_key(identity(model=uuid.uuid4().hex)), "5" * 64)  # never anchored
    report = data.draw(mutated({"instance_id": "i", "outcome": "failed", "error": "refused"}))
    r = peer.http.post(f"/v1/compile-caches/{key}/reports", json=report)
    want = 422 if _refused(CompileCacheReport, report) else 404
    assert r.status_code == want, r.text
    ask = data.draw(mutated({"identity_key": "a" * 64, "labels": {"node": "n"}, "exclude": ["i"]}))
    r = peer.http.post(f"/v1/compile-caches/{key}/sources", json=ask)
    want = 422 if _refused(CompileCacheRequest, ask) else 404
    assert r.status_code == want, r.text


def _refused(model: type[CompileCacheReport] | type[CompileCacheRequest], body: Any) -> bool:
    try:
        model.model_validate_json(json.dumps(body))
    except ValidationError:
        return True
    return False
