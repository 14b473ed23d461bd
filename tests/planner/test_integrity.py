"""Anchored integrity: the first disk-loaded publication anchors an identity's digests; later manifests
that differ are refused (409, metric, log) and their instance quarantined; only matching seeds are served;
a checksum-mismatch report quarantines at once."""

from __future__ import annotations

import copy
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner import AssignmentRequest, RankManifest, RegistrationRequest, TransferReport
from planner.contract import Conflict, PlannerClient, control_token, digest_set
from tests.planner.conftest import identity, make_planner, manifest, ranks


def _instance(c: PlannerClient, man: dict | None, *, control: bool = False) -> str:
    reg = c.register_instance(
        identity=identity(),
        ranks=ranks(0),
        control_url="http://127.0.0.2:9000" if control else None,
        control_key=control_token.new_control_key() if control else None,
    )
    if man is not None:
        c.put_manifest(reg.id, 0, man)
    c.set_status(reg.id, "READY")
    return reg.id


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def test_first_disk_publication_anchors_and_differing_manifests_are_refused(server, caplog):
    c = PlannerClient(server.url)
    peer_first = dict(manifest(0), origin="peer")
    unanchored = _instance(c, peer_first)
    # a peer-loaded publication never anchors: nothing is served yet
    assert c.request_assignment(identity=identity(), rank=0) is None
    anchor = _instance(c, manifest(0))  # loaded from disk, says so: anchors
    lease = c.request_assignment(identity=identity(), rank=0, exclude=[anchor])
    assert lease is not None
    assert lease.candidates[0].instance_id == unanchored  # its manifest matches the anchor: served
    want = digest_set("xxh64", manifest(0)["tensors"])
    assert lease.candidates[0].anchor.model_dump() == {
        "checksum_algorithm": "xxh64",
        "digest_set": want,
        "instance_id": anchor,
    }

    corrupted = copy.deepcopy(manifest(0))
    corrupted["tensors"][0]["checksum"] = "cd"
    refused_before = _metric(server.url, "rfork_planner_integrity_refusals_total")
    liar = c.register_instance(identity=identity(), ranks=ranks(0))
    with caplog.at_level("WARNING"), pytest.raises(Conflict) as err:
        c.put_manifest(liar.id, 0, corrupted)  # "disk" does not help: the anchor is already there
    assert err.value.reason == "digest_mismatch"
    assert "'w'" in str(err.value)
    assert _metric(server.url, "rfork_planner_integrity_refusals_total") == refused_before + 1
    assert any("differ from the anchor" in r.getMessage() for r in caplog.records)

    # a READY seed republishing different digests (its memory changed) is refused and taken out of
    # service until it republishes clean (issue #21: not for quarantine_s)
    with pytest.raises(Conflict):
        c.put_manifest(anchor, 0, corrupted)
    assert c.get_instance(anchor).integrity_failed
    lease2 = c.request_assignment(identity=identity(), rank=0, exclude=[unanchored])
    assert lease2 is None  # neither the quarantined seed nor the refused one is offered
    # the anchor is per checksum algorithm: a device-side digest anchors separately
    other_algo = dict(corrupted, checksum_algorithm="xxh3-128-cuda")
    c.put_manifest(liar.id, 0, other_algo)


def test_checksum_mismatch_report_takes_the_seed_out_until_it_reverifies(server):
    c = PlannerClient(server.url)
    seed = _instance(c, manifest(0))
    lease = c.request_assignment(identity=identity(), rank=0)
    assert lease is not None
    out = c.report_transfer(lease.id, outcome="failure", reason="checksum_mismatch", error="bad bytes")
    assert out.seed_quarantined is True
    assert c.get_instance(seed).reverifying
    assert c.heartbeat(seed).reverify
    assert c.request_assignment(identity=identity(), rank=0) is None
    c.put_manifest(seed, 0, manifest(0))  # re-hashed, clean: offered again at once
    assert not c.get_instance(seed).reverifying
    assert c.request_assignment(identity=identity(), rank=0) is not None


def test_reports_on_expired_leases_are_refused(planner_url):
    svc = make_planner(planner_url, lease_ttl_s=0.5)
    try:
        now = time.time()
        rank0 = {"rank": 0, "provider": "tcp", "address": "YWRkcjA=", "backends": ["tcp"]}
        registration = RegistrationRequest.model_validate({"identity": identity(), "ranks": [rank0]})
        seed = svc.register(registration, now)
        svc.put_manifest(seed.id, 0, RankManifest.model_validate(manifest(0)).model_dump_json(), now)
        svc.set_status(seed.id, "READY", now)
        ask = AssignmentRequest.model_validate({"identity": identity(), "rank": 0, "providers": ["tcp"]})
        lease = svc.assign(ask, now)
        with pytest.raises(Conflict, match="ended"):  # 0.8 s later: past lease_ttl_s
            svc.report(lease.id, TransferReport(outcome="failure", reason="checksum_mismatch"), now + 0.8)
    finally:
        svc.close()


@given(
    st.lists(
        st.tuples(
            st.text(min_size=1, max_size=8), st.sampled_from(["float32", "bfloat16"]), st.text(max_size=8)
        ),
        min_size=1,
        max_size=8,
        unique_by=lambda t: t[0],
    ),
    st.data(),
)
def test_digest_set_depends_on_content_not_order(rows, data):
    tensors = [{"name": n, "dtype": d, "shape": [2], "nbytes": 8, "checksum": c} for n, d, c in rows]
    shuffled = data.draw(st.permutations(tensors))
    assert digest_set("a", tensors) == digest_set("a", shuffled)
    assert digest_set("a", tensors) != digest_set("b", tensors)
    i = data.draw(st.integers(0, len(tensors) - 1))
    changed = [dict(t) for t in tensors]
    changed[i]["checksum"] += "0"
    assert digest_set("a", changed) != digest_set("a", tensors)
