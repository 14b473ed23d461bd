"""The fleet page's routes: /ui is static and holds no data, /v1/fleet needs a token (reader is
enough) and shows no addresses, descriptors or tokens; progress and seeded reports come only from a
live lease's holder; refusals and quarantines carry their reason; hostile bodies are 4xx, never 500."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.contract import AuthError, Conflict, NotFound, PlannerClient, identity_key
from planner.server import PlannerServer
from tests.planner.conftest import identity, manifest, ranks
from tests.waiting import wait_until

TOKENS: dict[str, Any] = {
    "admin_token": "adm-secret",
    "register_token": "reg-secret",
    "load_token": "load-secret",
    "reader_token": "read-secret",
    "anchor_token": "reg-secret",  # one string, both roles: the test's disk seeds anchor their identity
}
HOSTILE = "<img src=x onerror=alert(1)>"


@pytest.fixture
def secure(planner_url):
    with PlannerServer(db_url=planner_url, port=0, insecure=False, reaper_interval_s=3600, **TOKENS) as srv:
        yield srv


def _ready_seed(url: str, **ident: Any) -> tuple[str, PlannerClient]:
    reg = PlannerClient(url, token="reg-secret").register_instance(
        identity=identity(**ident), ranks=ranks(0, 1), labels={"node": "n1", "rack": "r1"}
    )
    own = PlannerClient(url, token=reg.token)
    own.put_manifest(reg.id, 0, manifest(0))
    own.put_manifest(reg.id, 1, manifest(1))
    own.set_status(reg.id, "READY")
    return reg.id, own


def test_page_is_static_and_locked_down(secure):
    page = httpx.get(secure.url + "/ui")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp
    assert "default-src 'none'" in csp
    assert '<script src="/ui/fleet.js"' in page.text
    assert "http" not in page.text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert httpx.get(secure.url + "/ui/fleet.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(secure.url + "/ui/fleet.css").status_code == 200
    assert httpx.get(secure.url + "/ui/..%2Fauth.py").status_code == 404
    assert httpx.get(secure.url + "/ui/nothing.js").status_code == 404


def test_fleet_needs_a_token_and_hides_secrets(secure):
    seed_id, _ = _ready_seed(secure.url, model=HOSTILE)
    assert httpx.get(secure.url + "/v1/fleet").status_code == 401
    assert httpx.get(secure.url + "/v1/fleet", headers={"Authorization": "Bearer nope"}).status_code == 401
    reader = PlannerClient(secure.url, token="read-secret")
    view = reader.fleet()
    assert [i.id for i in view.instances] == [seed_id]
    assert view.identities[0].model == HOSTILE  # data, as given: the page renders it as text
    assert view.identities[0].layout == "tp2 pp1 ep1 dp1"
    assert [a.rank for a in view.identities[0].anchors] == [0, 1]  # anchored (origin disk)
    assert [a.checksum_algorithm for a in view.identities[0].anchors] == ["xxh64", "xxh64"]
    assert not any(a.cryptographic for a in view.identities[0].anchors)  # the page says which digest
    inst = view.instances[0]
    assert (inst.status.value, inst.labels.node, inst.pulls, inst.max_concurrent_pulls) == (
        "READY",
        "n1",
        0,
        2,
    )
    raw = httpx.get(secure.url + "/v1/fleet", headers={"Authorization": "Bearer read-secret"}).text
    for secret in ("address", "descriptor", "token", "control", "ZGVzYw==", "addr0"):
        assert secret not in raw  # base64 of the manifest's descriptor, the rank address, keys


def test_progress_and_seeded_come_from_the_lease_holder(secure):
    seed_id, seed_client = _ready_seed(secure.url)
    loader = PlannerClient(secure.url, token="load-secret")
    lease = loader.request_assignment(identity=identity(), rank=0)
    assert lease is not None
    loader.report_progress(lease.id, bytes_done=32, bytes_total=64)
    view = PlannerClient(secure.url, token="read-secret").fleet()
    (edge,) = view.edges
    assert (edge.seed_id, edge.live, edge.bytes_done, edge.bytes_total, edge.transport) == (
        seed_id,
        True,
        32,
        64,
        "tcp",
    )
    assert view.instances[0].pulls == 1
    with pytest.raises(AuthError):  # another principal (the seed's own token) is not the holder
        seed_client.report_progress(lease.id, bytes_done=1, bytes_total=64)
    with pytest.raises(AuthError):  # a reader may not report
        PlannerClient(secure.url, token="read-secret").report_progress(lease.id, bytes_done=1, bytes_total=2)
    with pytest.raises(Conflict):
        loader.report_progress(lease.id, bytes_done=65, bytes_total=64)
    with pytest.raises(NotFound):
        loader.report_progress("0" * 32, bytes_done=1, bytes_total=2)
    with pytest.raises(Conflict):  # not reported yet: nothing to link
        loader.report_seeded(lease.id, seed_id)
    loader.report_transfer(lease.id, outcome="success", bytes=64, seconds=0.5, backend="tcp")
    with pytest.raises(Conflict):  # the lease has ended
        loader.report_progress(lease.id, bytes_done=64, bytes_total=64)

    became = PlannerClient(secure.url, token="reg-secret").register_instance(
        identity=identity(), ranks=ranks(0)
    )
    with pytest.raises(NotFound):
        loader.report_seeded(lease.id, "f" * 32)
    loader.report_seeded(lease.id, became.id)
    loader.report_seeded(lease.id, became.id)  # the same link again is fine
    with pytest.raises(Conflict):
        loader.report_seeded(lease.id, seed_id)
    view = PlannerClient(secure.url, token="read-secret").fleet()
    (edge,) = view.edges
    assert (edge.loader_id, edge.live, edge.bytes_done, edge.outcome) == (became.id, False, 64, "success")
    (t,) = view.transfers
    assert (t.loader_id, t.outcome, t.bytes, t.gbps) == (
        became.id,
        "success",
        64,
        pytest.approx(64 / 0.5 / 1e9),
    )


def test_refusals_and_quarantines_carry_their_reason(secure):
    loader = PlannerClient(secure.url, token="load-secret")
    assert loader.request_assignment(identity=identity(model="nobody"), rank=0) is None  # 404 no_source
    seed_id, _ = _ready_seed(secure.url)
    lease = loader.request_assignment(identity=identity(), rank=0)
    assert lease is not None
    loader.report_transfer(lease.id, outcome="failure", reason="checksum_mismatch", error="bad bytes")
    view = PlannerClient(secure.url, token="read-secret").fleet()
    (refusal,) = view.refusals
    assert (refusal.reason, refusal.rank) == ("no_source", 0)
    assert refusal.identity_key == identity_key(identity(model="nobody"))
    (inst,) = view.instances
    assert inst.id == seed_id
    # one checksum report takes a seed out of service until it re-hashes its memory (issue #21)
    assert inst.quarantine_reason == "re-verifying its memory after a checksum report"
    assert inst.quarantined_for_s is None
    (t,) = view.transfers
    assert (t.outcome, t.reason) == ("failure", "checksum_mismatch")
    assert view.edges == []  # a failed pull draws no edge


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.one_of(
        st.dictionaries(
            st.sampled_from(["bytes_done", "bytes_total", "x"]),
            st.one_of(
                st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=5), st.none()
            ),
        ),
        st.lists(st.integers(), max_size=3),
        st.text(max_size=20),
    )
)
def test_hostile_progress_bodies_are_4xx(secure_module, body):
    http, lease_id = secure_module
    for path in ("progress", "seeded"):
        resp = http.post(
            f"/v1/assignments/{lease_id}/{path}",
            content=json.dumps(body),
            headers={"Authorization": "Bearer load-secret", "Content-Type": "application/json"},
        )
        assert resp.status_code in (204, 409, 422), resp.text
        assert resp.status_code != 204 or path == "progress"


@pytest.fixture
def secure_module(secure):
    """A live lease held by the load token, and one HTTP client for all the examples (a client per
    request builds a TLS context, tens of ms each)."""
    _ready_seed(secure.url)
    lease = PlannerClient(secure.url, token="load-secret").request_assignment(identity=identity(), rank=0)
    assert lease is not None
    with httpx.Client(base_url=secure.url) as http:
        yield http, lease.id


def test_serve_prints_the_page_address(sqlite_url, tmp_path):
    """`rfork planner serve` says where the fleet page is, and the page is there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "serve.out"
    with out.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rfork", "planner", "serve", "--db", sqlite_url, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "RFORK_READER_TOKEN": "read-secret", "RFORK_REAPER_INTERVAL_S": "3600"},
        )
    def said() -> bool:
        assert proc.poll() is None, out.read_text()
        return "fleet page:" in out.read_text()

    def get(url: str) -> httpx.Response | None:
        try:
            return httpx.get(url)
        except httpx.ConnectError:
            return None

    try:
        wait_until(said, 60, "the planner prints the fleet page's address")
        (line,) = [ln for ln in out.read_text().splitlines() if ln.startswith("fleet page:")]
        url = line.split()[2]
        assert url == f"http://127.0.0.1:{port}/ui"
        page = wait_until(lambda: get(url), 60, "the fleet page answers")
        assert page is not None
        assert page.status_code == 200
        assert "rfork fleet" in page.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


NAME = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), min_size=1, max_size=40)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=NAME, revision=NAME, node=NAME.filter(lambda s: len(s) <= 256))
def test_any_name_a_peer_registers_comes_back_verbatim(secure, model, revision, node):
    """Names are whatever a registrant sent: the fleet view returns them unchanged (the page shows text)."""
    reg = PlannerClient(secure.url, token="reg-secret").register_instance(
        identity=identity(model=model, revision=revision), labels={"node": node}
    )
    view = PlannerClient(secure.url, token="read-secret").fleet()
    (inst,) = [i for i in view.instances if i.id == reg.id]
    (ident,) = [d for d in view.identities if d.identity_key == inst.identity_key]
    assert (ident.model, ident.revision, inst.labels.node) == (model, revision, node)
    PlannerClient(secure.url, token="adm-secret").delete_instance(reg.id)
