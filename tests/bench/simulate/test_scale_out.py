"""bench.simulate: the flow model and the real planner on simulated time."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.simulate.fleet import SCENARIOS, BandwidthModel, FleetSim, hub_baseline, migrated_template
from bench.simulate.flows import Network
from tests.rfork_cli import run_rfork


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return migrated_template(tmp_path_factory.mktemp("sim-template"))


def test_flow_model_shares_a_nic_max_min_fairly():
    net = Network(capacity={"a": 10.0, "b": 4.0, "c": 100.0})
    net.start("x", 100, ["a", "c"])
    net.start("y", 100, ["a", "b"])
    # y is held to 4 by b; x gets the rest of a: 6
    dt, first = net.next_completion()  # type: ignore[misc]
    assert (first, dt) == ("x", pytest.approx(100 / 6))
    net.advance(dt)
    net.finish("x")
    assert net.flows["y"].remaining == pytest.approx(100 - 4 * 100 / 6)
    dt2, _ = net.next_completion()  # type: ignore[misc]
    assert dt2 == pytest.approx((100 - 4 * 100 / 6) / 4)
    with pytest.raises(ValueError, match="no capacity"):
        net.start("z", 1, ["nowhere"])


def test_hub_baseline_and_ideal_tree_follow_the_model():
    m = BandwidthModel(model_gb=100, nic_gbit_s=800, hub_gbit_s=800, ready_overhead_s=1)
    assert m.ideal_tree_s(1) == pytest.approx(1 * (1 + 1))  # 100 GB at 100 GB/s + 1 s
    assert m.ideal_tree_s(1000) == pytest.approx(10 * 2)
    assert hub_baseline(m, 4) == pytest.approx(4 + 1)  # the hub's 100 GB/s shared by four


def test_simulated_tree_stays_within_limits_and_beats_one_seed(template, tmp_path):
    m = BandwidthModel(max_concurrent_pulls=2)
    tree = FleetSim(
        model=m, scenario=SCENARIOS["tree-load-aware"], instances=24, template=template, workdir=tmp_path
    ).run()
    one = FleetSim(
        model=m, scenario=SCENARIOS["first-seed-only"], instances=24, template=template, workdir=tmp_path
    ).run()
    assert tree.sources == {"seed": 24, "disk": 0}
    assert tree.max_pulls_per_seed <= 2
    assert one.max_pulls_per_seed <= 2
    assert tree.all_ready_s <= 1.5 * m.ideal_tree_s(24)
    assert tree.all_ready_s < one.all_ready_s
    # every loader pulled from the seed or from a loader that was READY before it started
    ready_at = {f"n{i}": t for i, t in enumerate(tree.ready_s)} | {"seed0": 0.0}
    for child, parent in tree.parents.items():
        assert parent in ready_at
        assert ready_at[parent] < ready_at[child]
    # with the tree off, loaders far back in line are told their disk is sooner, and take it
    assert one.sources["disk"] > 0
    assert one.all_ready_s <= m.disk_s() + 2 * (m.nbytes / m.nic_bps * 2 + m.ready_overhead_s)


def test_simulator_decisions_match_the_real_planner_over_http(template, tmp_path):
    """Same state (a snapshot of the simulator's database), same request: the HTTP planner decides alike."""
    from planner import PlannerServer

    snaps: dict[int, tuple[Path, dict]] = {}

    def before_assign(db: Path, body: dict, call: int) -> None:
        snap = tmp_path / f"snap-{call}.db"
        with sqlite3.connect(db) as src, sqlite3.connect(snap) as dst:
            src.backup(dst)
        snaps[call] = (snap, json.loads(json.dumps(body)))

    res = FleetSim(
        model=BandwidthModel(max_concurrent_pulls=2),
        scenario=SCENARIOS["tree-load-aware"],
        instances=8,
        template=template,
        workdir=tmp_path,
        before_assign=before_assign,
        record_decisions=True,
    ).run()
    leased = [d for d in res.decisions if d["result"] == "leased"]
    busy = [d for d in res.decisions if d["result"] == "all_busy"]
    assert len(leased) == 8
    assert busy
    picked = leased[:2] + leased[-2:] + busy[:2]
    for d in picked:
        snap, body = snaps[d["call"]]
        body.pop("waited_s")  # the HTTP planner has its own (empty) waiting room
        with PlannerServer(db_url=f"sqlite:///{snap}", insecure=True, heartbeat_ttl_s=1e9) as srv:
            r = httpx.post(f"{srv.url}/v1/assignments", json=body, timeout=30)
        if d["result"] == "leased":
            assert r.status_code == 201, r.text
            assert [c["instance_id"] for c in r.json()["candidates"]] == d["candidates"]
        else:
            assert r.status_code == 429, r.text
            assert r.json()["reason"] == "all_busy"


def test_simulate_cli_writes_json_markdown_and_plot(tmp_path, capsys):
    out, md, png = tmp_path / "sim.json", tmp_path / "sim.md", tmp_path / "sim.png"
    status, _, stderr = run_rfork(
        ["simulate", "scale-out", "--instances", "6", "--points", "1", "6",
         "--json", str(out), "--markdown", str(md), "--plot", str(png)],
        capsys,
    )  # fmt: skip
    assert status == 0, stderr
    doc = json.loads(out.read_text())
    assert [r["instances"] for r in doc["rows"]] == [1, 6]
    six = doc["rows"][-1]
    for name in SCENARIOS:
        assert six[name]["max_pulls_per_seed"] <= doc["model"]["max_concurrent_pulls"]
        assert six[name]["from_seed"] + six[name]["from_disk"] == 6
        assert six[name]["ms_per_decision"] > 0  # the real planner's own time per decision
    assert "| 6 |" in md.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    status, _, stderr = run_rfork(["simulate", "scale-out", "--instances", "0"], capsys)
    assert status != 0
    assert "--instances" in stderr


def test_racks_with_thin_uplinks_complete_within_limits(template, tmp_path):
    """Pulls across racks share the uplinks; every policy still finishes with no seed over its limit
    and no slower than the first seed alone would serve everyone."""
    m = BandwidthModel(racks=4, uplink_gbit_s=400.0)
    for name in ("tree-load-aware", "tree-random"):
        sim = FleetSim(model=m, scenario=SCENARIOS[name], instances=16, template=template, workdir=tmp_path)
        r = sim.run()
        assert r.sources["seed"] == 16
        assert r.max_pulls_per_seed <= 2
        assert r.all_ready_s < 16 / 2 * (m.nbytes / m.nic_bps * 2) + m.ready_overhead_s


@settings(max_examples=100, deadline=None)
@given(
    caps=st.lists(st.sampled_from([1.0, 2.5, 4.0, 10.0]), min_size=1, max_size=6),
    flows=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True), max_size=12),
)
def test_flow_rates_are_max_min_fair(caps, flows):
    # what max-min fairness means: no resource over capacity, and every flow crosses a full resource
    # on which no other flow gets more (else it could grow without taking from a slower one)
    net = Network(capacity=dict(enumerate(caps)))
    for n, res in enumerate(flows):
        net.start(n, 100.0, list(dict.fromkeys(r % len(caps) for r in res)))
    net.next_completion()
    got = net.flows
    for r, c in enumerate(caps):
        assert sum(f.rate for f in got.values() if r in f.resources) <= c * (1 + 1e-9)
    for f in got.values():
        assert any(
            sum(g.rate for g in got.values() if r in g.resources) >= caps[r] * (1 - 1e-9)
            and all(g.rate <= f.rate * (1 + 1e-9) for g in got.values() if r in g.resources)
            for r in f.resources
        )
