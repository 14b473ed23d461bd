"""Anchors set by an authority (issue #21, finding 1-2): only an instance registered with the `anchor`
role (or an admin upload) sets an identity's digests; admins list and revoke anchors; concurrent first
publications on PostgreSQL end with one anchor and no error."""

from __future__ import annotations

import copy
import threading
from typing import Any

import httpx
import pytest

from planner.contract import NoSource, PlannerClient, identity_key
from planner.server import PlannerServer
from planner.service import Planner
from planner.settings import PlannerSettings
from tests.planner.conftest import identity, manifest, ranks

TOKENS: dict[str, Any] = {
    "admin_token": "adm",
    "register_token": "reg",
    "anchor_token": "anc",
    "load_token": "load",
    "reader_token": "read",
}


@pytest.fixture
def secure(planner_url):
    with PlannerServer(db_url=planner_url, port=0, insecure=False, reaper_interval_s=3600, **TOKENS) as srv:
        yield srv


def _forged(rank: int = 0) -> dict[str, Any]:
    m = copy.deepcopy(manifest(rank))
    m["tensors"][0]["checksum"] = "ff"  # what a squatter would publish
    return m


def test_a_register_token_cannot_squat_an_identitys_anchor(secure):
    """A squatter's disk manifest anchors nothing; the honest disk seed, registered with the anchor role,
    anchors afterwards, is not quarantined and is the one served."""
    squatter = PlannerClient(secure.url, token="reg").register_instance(identity=identity(), ranks=ranks(0))
    as_squatter = PlannerClient(secure.url, token=squatter.token)
    as_squatter.put_manifest(squatter.id, 0, _forged())  # stored, but it anchors nothing
    as_squatter.set_status(squatter.id, "READY")

    honest = PlannerClient(secure.url, token="anc").register_instance(identity=identity(), ranks=ranks(0))
    as_honest = PlannerClient(secure.url, token=honest.token)
    as_honest.put_manifest(honest.id, 0, manifest(0))  # 204, anchors
    as_honest.set_status(honest.id, "READY")

    admin = PlannerClient(secure.url, token="adm")
    assert admin.get_instance(honest.id).quarantined_until is None
    load = PlannerClient(secure.url, token="load")
    for _ in range(3):
        lease = load.request_assignment(identity=identity(), rank=0)
        assert lease is not None
        assert [c.instance_id for c in lease.candidates] == [honest.id]
        load.report_transfer(lease.id, outcome="success", bytes=1, seconds=1.0)


def test_admins_list_upload_and_revoke_anchors(secure):
    key = identity_key(identity())
    adm = {"Authorization": "Bearer adm"}
    reg = PlannerClient(secure.url, token="anc").register_instance(identity=identity(), ranks=ranks(0))
    PlannerClient(secure.url, token=reg.token).put_manifest(reg.id, 0, manifest(0))

    listed = httpx.get(secure.url + "/v1/anchors", headers=adm).json()
    assert [(a["identity_key"], a["rank"], a["set_by"]) for a in listed["items"]] == [
        (key, 0, "instance:" + reg.id)
    ]
    for tok in ("reg", "load", "read", "anc", reg.token):  # only admins see or change anchors
        assert (
            httpx.get(secure.url + "/v1/anchors", headers={"Authorization": f"Bearer {tok}"}).status_code
            == 403
        )
    url = f"{secure.url}/v1/anchors/{key}/0/xxh64"
    assert httpx.delete(url, headers={"Authorization": "Bearer reg"}).status_code == 403
    assert httpx.delete(url, headers=adm).status_code == 204
    assert httpx.delete(url, headers=adm).status_code == 404
    assert httpx.get(secure.url + "/v1/anchors", headers=adm).json()["items"] == []
    # revoked: the seed is no longer served until an anchor exists again
    PlannerClient(secure.url, token=reg.token).set_status(reg.id, "READY")
    assert PlannerClient(secure.url, token="load").request_assignment(identity=identity(), rank=0) is None

    # an admin uploads the digests (what `rfork digest CHECKPOINT` writes)
    tensors = [
        {k: t[k] for k in ("name", "dtype", "shape", "nbytes", "checksum")} for t in manifest(0)["tensors"]
    ]
    body = {"identity": identity(), "rank": 0, "checksum_algorithm": "xxh64", "tensors": tensors}
    assert (
        httpx.put(secure.url + "/v1/anchors", json=body, headers={"Authorization": "Bearer reg"}).status_code
        == 403
    )
    put = httpx.put(secure.url + "/v1/anchors", json=body, headers=adm)
    assert put.status_code == 200, put.text
    assert put.json()["instance_id"] == ""
    assert put.json()["set_by"].startswith("token:")  # the admin token's holder name, never the token
    assert PlannerClient(secure.url, token="load").request_assignment(identity=identity(), rank=0) is not None
    bad = httpx.put(secure.url + "/v1/anchors", json={**body, "rank": 7}, headers=adm)
    assert bad.status_code == 409  # outside tp*pp
    assert "rank" in bad.json()["detail"]


@pytest.mark.postgres
def test_concurrent_first_publications_on_postgres_end_with_one_anchor(postgres_url):
    """Many disk seeds of one identity publish at once (a cold-start burst): none fails, one anchors."""
    from tests.planner.conftest import empty_database

    url = empty_database(postgres_url)
    svc = Planner.open(PlannerSettings(db_url=url, insecure=True, db_pool_size=16))
    try:
        for attempt in range(4):  # a race: repeat to make losing it likely without the fix
            key_identity = identity(revision=f"r{attempt}")
            regs = [svc.register(_registration(key_identity), 1.0, may_anchor=True) for _ in range(12)]
            barrier = threading.Barrier(len(regs))
            errors: list[BaseException] = []
            anchored: list[bool] = []

            def publish(
                iid: str,
                barrier: threading.Barrier = barrier,
                anchored: list[bool] = anchored,
                errors: list[BaseException] = errors,
            ) -> None:
                barrier.wait()
                try:
                    anchored.append(svc.put_manifest(iid, 0, _json(manifest(0)), 2.0))
                except BaseException as exc:  # noqa: BLE001 - collected and asserted below
                    errors.append(exc)

            threads = [threading.Thread(target=publish, args=(r.id,)) for r in regs]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == []
            assert anchored.count(True) == 1
    finally:
        svc.close()


def _registration(ident: dict[str, Any]) -> Any:
    from planner.contract import RegistrationRequest

    rank0 = {"rank": 0, "provider": "tcp", "address": "YWRkcjA=", "backends": ["tcp"]}
    return RegistrationRequest.model_validate({"identity": ident, "ranks": [rank0]})


def _json(m: dict[str, Any]) -> str:
    import json

    return json.dumps(m)


def test_a_rank_without_an_anchor_is_refused_as_not_anchored(secure):
    """A READY seed registered without the anchor role serves nothing until its identity is anchored, and
    the 404 says so (before, it read like any missing seed); once anchored, a missing seed is no_source."""
    seed = PlannerClient(secure.url, token="reg").register_instance(identity=identity(), ranks=ranks(0))
    own = PlannerClient(secure.url, token=seed.token)
    own.put_manifest(seed.id, 0, manifest(0))  # stored; a register-role manifest anchors nothing
    own.set_status(seed.id, "READY")
    load = PlannerClient(secure.url, token="load")
    assert load.request_assignment(identity=identity(), rank=0) is None  # the default answer stays None
    with pytest.raises(NoSource, match="is not anchored") as refused:
        load.request_assignment(identity=identity(), rank=0, raise_no_source=True)
    assert refused.value.anchored is False

    anchor = PlannerClient(secure.url, token="anc").register_instance(identity=identity(), ranks=ranks(0))
    PlannerClient(secure.url, token=anchor.token).put_manifest(anchor.id, 0, manifest(0))  # anchors rank 0
    with pytest.raises(NoSource) as missing:  # anchored, both seeds excluded: no source, anchored
        load.request_assignment(
            identity=identity(), rank=0, exclude=[seed.id, anchor.id], raise_no_source=True
        )
    assert missing.value.anchored is True
    assert "not anchored" not in str(missing.value)
