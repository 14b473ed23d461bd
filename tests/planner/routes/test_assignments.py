"""/v1/assignments through the client: matching, provider choice, limits, reports, topology."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from planner.contract import AllBusy, Conflict, NotFound, PlannerClient, RankManifest
from tests.planner.conftest import identity, manifest, ranks


def _seed(
    c: PlannerClient,
    *,
    node: str = "n1",
    rack: str = "r1",
    zone: str = "z1",
    limit: int = 2,
    backends: tuple[str, ...] = ("tcp", "nccl"),
    ident: dict | None = None,
) -> str:
    reg = c.register_instance(
        identity=ident or identity(),
        labels={"node": node, "rack": rack, "zone": zone},
        ranks=ranks(0, 1, backends=backends),
        max_concurrent_pulls=limit,
        control_url=f"http://{node}:9",
    )
    c.put_manifest(reg.id, 0, manifest(0))
    c.put_manifest(reg.id, 1, manifest(1))
    c.set_status(reg.id, "READY")
    return reg.id


def test_no_source_then_lease_limit_and_report(server):
    c = PlannerClient(server.url)
    assert c.request_assignment(identity=identity(), rank=0) is None
    seed = _seed(c, limit=2)
    assert c.request_assignment(identity=identity(fingerprint="other"), rank=0) is None
    assert c.request_assignment(identity=identity(), rank=0, exclude=[seed]) is None
    a1 = c.request_assignment(identity=identity(), rank=0, labels={"node": "n9"})
    assert a1 is not None
    cand = a1.candidates[0]
    assert (cand.instance_id, cand.rank, cand.provider, cand.address_bytes()) == (seed, 0, "tcp", b"addr0")
    assert cand.rank_manifest() == RankManifest.model_validate(manifest(0))
    assert cand.control_url == "http://n1:9"
    assert a1.expires_at_unix > time.time()
    a2 = c.request_assignment(identity=identity(), rank=0)
    with pytest.raises(AllBusy) as busy:
        c.request_assignment(identity=identity(), rank=0)
    assert busy.value.retry_after_s > 0
    # rank 1 has its own limit
    assert c.request_assignment(identity=identity(), rank=1) is not None
    c.report_transfer(a1.id, outcome="success", bytes=64, seconds=0.5, backend="tcp")
    with pytest.raises(Conflict):
        c.report_transfer(a1.id, outcome="success", bytes=64, seconds=0.5, backend="tcp")
    a3 = c.request_assignment(identity=identity(), rank=0)
    assert a3 is not None
    assert a2 is not None
    c.report_transfer(a2.id, outcome="failure", error="checksum mismatch", backend="tcp")
    hist = c.transfers()
    assert hist.total == 2
    ok = next(t for t in hist.items if t.outcome == "success")
    assert ok.bytes == 64
    assert ok.gbps == pytest.approx(64 / 0.5 / 1e9)
    with pytest.raises(NotFound):
        c.report_transfer("f" * 32, outcome="success")
    models = c.models()
    assert models.items[0].ready == 1
    assert models.items[0].identity["model"] == "llama-test"


def test_provider_choice(server):
    c = PlannerClient(server.url)
    shm_seed = _seed(c, node="a", backends=("shm", "tcp"))
    nccl_seed = _seed(c, node="b", backends=("nccl",))
    a = c.request_assignment(identity=identity(), rank=0, providers=["tcp", "shm"], backends=["nccl"])
    assert a is not None
    by_id = {x.instance_id: x.provider for x in a.candidates}
    assert by_id == {shm_seed: "tcp", nccl_seed: "nccl"}
    # a loader without nccl never gets the nccl-only seed
    b = c.request_assignment(identity=identity(), rank=1, providers=["efa"], backends=[])
    assert b is None
    d = c.request_assignment(identity=identity(), rank=1, providers=["shm"], backends=[])
    assert d is not None
    assert [(x.instance_id, x.provider) for x in d.candidates] == [(shm_seed, "shm")]


def test_topology_preference(server):
    c = PlannerClient(server.url)
    far = _seed(c, node="x", rack="rx", zone="zx")
    zone = _seed(c, node="y", rack="ry", zone="z1")
    rack = _seed(c, node="w", rack="r1", zone="z1")
    node = _seed(c, node="n1", rack="r1", zone="z1")
    a = c.request_assignment(identity=identity(), rank=0, labels={"node": "n1", "rack": "r1", "zone": "z1"})
    assert a is not None
    assert [x.instance_id for x in a.candidates] == [node, rack, zone]  # max_candidates = 3
    assert far not in [x.instance_id for x in a.candidates]


def _counter(planner_url: str, name: str, **labels: str) -> float:
    """A sample of the planner's /metrics (0 when absent), read over HTTP."""
    text = httpx.get(f"{planner_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def test_every_assignment_answer_and_an_aborted_pull_are_counted_as_what_they_are(server):
    """rfork_planner_assignments_total counts refusals by reason (an alert on `no_source` or `all_busy`
    can fire), and a pull its loader aborted is counted `aborted`, not `failure`."""
    c = PlannerClient(server.url)
    assert c.request_assignment(identity=identity(), rank=0) is None
    _seed(c, limit=1)
    lease = c.request_assignment(identity=identity(), rank=0)
    assert lease is not None
    with pytest.raises(AllBusy):
        c.request_assignment(identity=identity(), rank=0)
    c.report_transfer(lease.id, outcome="failure", bytes=0, seconds=0.1, backend="tcp", reason="aborted")
    total = "rfork_planner_assignments_total"
    assert _counter(server.url, total, result="no_source") == 1
    assert _counter(server.url, total, result="all_busy") == 1
    assert _counter(server.url, total, result="leased") == 1
    assert _counter(server.url, "rfork_planner_transfers_total", outcome="aborted") == 1
    assert _counter(server.url, "rfork_planner_transfers_total", outcome="failure") == 0
