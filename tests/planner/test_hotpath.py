"""planner.hotpath answers what the FastAPI routes answer; the heartbeat batcher's group commit."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from planner import PlannerServer, RegistrationRequest, migrate
from planner.contract import PlannerClient
from planner.heartbeats import HeartbeatBatcher
from tests.planner.conftest import identity, manifest, ranks

LOAD = "load-secret"
ADMIN, REGISTER = "adm-secret", "reg-secret"


@pytest.fixture
def secure(sqlite_url):
    migrate(sqlite_url)
    with PlannerServer(
        db_url=sqlite_url,
        port=0,
        insecure=False,
        reaper_interval_s=3600,
        admin_token=ADMIN,
        load_token=LOAD,
        register_token=REGISTER,
    ) as srv:
        yield srv


def _seed(server: PlannerServer) -> str:
    c = PlannerClient(server.url, token="adm-secret")
    seed = c.register_instance(identity=identity(), ranks=ranks(0), max_concurrent_pulls=4).id
    c.put_manifest(seed, 0, manifest(0))
    c.set_status(seed, "READY")
    return seed


def test_odd_assignment_requests_get_the_routes_answers(secure):
    _seed(secure)
    url = secure.url + "/v1/assignments"
    good = {"identity": identity(), "rank": 0, "providers": ["tcp"]}
    auth = {"authorization": f"Bearer {LOAD}"}
    with httpx.Client(timeout=30) as http:
        ok = http.post(url, json=good, headers=auth)
        assert ok.status_code == 201, ok.text
        assert ok.json()["candidates"][0]["manifest"] == manifest(0)
        # NaN: json.loads reads it, orjson does not; the app's parser decides (a float field is not there)
        nan = http.post(url, content=b'{"rank": NaN}', headers={**auth, "content-type": "application/json"})
        assert nan.status_code == 422
        assert nan.json()["message"].startswith("invalid request")
        wrong = {**good, "rank": -1, "typo": 1}
        bad = http.post(url, json=wrong, headers=auth)
        assert bad.status_code == 422
        assert {tuple(e["loc"]) for e in bad.json()["detail"]} == {("body", "rank"), ("body", "typo")}
        text = http.post(url, content=b"{}", headers={**auth, "content-type": "text/plain"})
        assert text.status_code == 422
        assert http.post(url, json=good).status_code == 401
        assert http.post(url, json=good, headers={"authorization": "Bearer nope"}).status_code == 401
        registrar = http.post(url, json=good, headers={"authorization": f"Bearer {REGISTER}"})
        assert registrar.status_code == 403  # the register role may not lease
        raw = json.dumps(good).encode()  # no Content-Length: sent chunked, read by the app
        chunked = http.post(
            url, content=iter([raw[:9], raw[9:]]), headers={**auth, "content-type": "application/json"}
        )
        assert chunked.status_code == 201, chunked.text
        lease = ok.json()["id"]
        report = {"outcome": "success", "bytes": 1, "seconds": 0.1}
        other = http.post(
            f"{url}/{lease}/report", json=report, headers={"authorization": "Bearer adm-secret"}
        )
        assert other.status_code == 200  # admin may report any lease
        again = http.post(f"{url}/{lease}/report", json=report, headers=auth)
        assert again.status_code == 409
        assert http.post(f"{url}/{'f' * 32}/report", json=report, headers=auth).status_code == 404
        assert http.post(f"{url}/{'F' * 32}/report", json=report, headers=auth).status_code == 422
        metrics = http.get(secure.url + "/metrics").text
    assert 'route="/v1/assignments",status="201"' in metrics
    assert 'route="/v1/assignments/{assignment_id}/report",status="409"' in metrics


def test_another_holders_report_is_refused_and_the_lease_stays_live(secure):
    _seed(secure)
    admin = PlannerClient(secure.url, token="adm-secret")
    loader = admin.register_instance(identity=identity(), ranks=ranks(0))  # its token may lease (admin)
    mine = PlannerClient(secure.url, token=LOAD).request_assignment(identity=identity(), rank=0)
    assert mine is not None
    answer = httpx.post(
        f"{secure.url}/v1/assignments/{mine.id}/report",
        json={"outcome": "success"},
        headers={"authorization": f"Bearer {loader.token}"},
    )
    assert answer.status_code == 403
    assert "another requester" in answer.text
    PlannerClient(secure.url, token=LOAD).report_transfer(mine.id, outcome="success")


def test_a_lone_heartbeat_does_not_wait_for_the_interval_and_concurrent_ones_share_a_write(svc, monkeypatch):
    ids = [svc.register(_registration(), time.time()).id for _ in range(3)]
    writes: list[list[str]] = []
    real = svc.heartbeat_many

    def counted(instance_ids, now):
        writes.append(list(instance_ids))
        return real(instance_ids, now)

    monkeypatch.setattr(svc, "heartbeat_many", counted)  # a spy on the real write
    batcher = HeartbeatBatcher(svc, interval_s=0.5)

    async def scenario() -> tuple[float, list[object]]:
        t0 = time.perf_counter()
        first = await batcher.beat(ids[0])  # nothing before it: written at once
        lone = time.perf_counter() - t0
        assert first == ("INITIALIZING", False)
        together = await asyncio.gather(*(batcher.beat(i) for i in [*ids, "0" * 32]))
        return lone, list(together)

    lone, together = asyncio.run(scenario())
    assert lone < 0.25  # the old batcher slept interval_s (0.5 s) before every write
    assert together == [("INITIALIZING", False)] * 3 + [None]
    assert writes[0] == [ids[0]]
    assert sorted(writes[1]) == sorted([*ids, "0" * 32])  # one UPDATE for the four that came together
    assert len(writes) == 2


def _registration() -> RegistrationRequest:
    rank0 = {"rank": 0, "provider": "tcp", "address": "YWRkcjA=", "backends": ["tcp"]}
    return RegistrationRequest.model_validate({"identity": identity(), "ranks": [rank0]})
