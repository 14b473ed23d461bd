"""The fleet harness's arithmetic and parsing, without namespaces: ideal times, logs, topology, CPU."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.fleet.hosts import CpuSampler
from bench.fleet.network import BENCH_NET, HostSpec, build_topology
from bench.fleet.report import ideal_rack_tree_s, ideal_tree_s, transfer_s
from bench.fleet.run import parse_instance_log, parse_planner_log


def test_ideal_tree_doubles_per_transfer_and_storage_speedups_match_the_issue():
    t = transfer_s(500_000_000, 500.0)
    assert t == pytest.approx(8.0)
    assert ideal_tree_s(8, 500_000_000, 500.0) == pytest.approx(4 * t)  # ceil(log2 9)
    assert ideal_tree_s(16, 500_000_000, 500.0) == pytest.approx(5 * t)
    # all from one storage link of one NIC: N transfers; the ideal speed-ups 2.0x and 3.2x
    assert 8 * t / ideal_tree_s(8, 500_000_000, 500.0) == pytest.approx(2.0)
    assert 16 * t / ideal_tree_s(16, 500_000_000, 500.0) == pytest.approx(3.2)


def test_ideal_rack_tree_with_one_nic_of_uplink():
    t = transfer_s(500_000_000, 500.0)
    # 2 racks of 8 loaders, seed in rack 0: 5 generations, as a flat tree of 16
    assert ideal_rack_tree_s([8, 8], 500_000_000, 500.0, 500.0) == pytest.approx(5 * t)
    # an unshaped uplink is the flat tree
    assert ideal_rack_tree_s([8, 8], 500_000_000, 500.0, 0.0) == pytest.approx(
        ideal_tree_s(16, 500_000_000, 500.0)
    )


@given(
    per_rack=st.lists(st.integers(0, 40), min_size=1, max_size=6), cross=st.sampled_from([0.0, 500.0, 2000.0])
)
def test_ideal_rack_tree_is_never_faster_than_the_flat_tree(per_rack, cross):
    n = sum(per_rack)
    racked = ideal_rack_tree_s(per_rack, 10**9, 1000.0, cross)
    assert racked >= ideal_tree_s(n, 10**9, 1000.0) - 1e-9 if n else racked == 0


def test_topology_addresses_stay_in_the_benchmark_range():
    topo = build_topology(hosts=40, racks=3, nic_mbit=500, uplink_mbit=500, storage_mbit=500)
    addrs = [ipaddress.ip_address(h.address) for h in topo.hosts]
    assert all(a in BENCH_NET for a in addrs)
    assert len(set(addrs)) == len(addrs)
    assert {h.rack for h in topo.hosts if h.name.startswith("h")} == {0, 1, 2}
    with pytest.raises(ValueError, match="198.18.0.0/15"):
        HostSpec(name="x", rack=None, nic_mbit=1, address="10.0.0.1")


def test_instance_and_planner_logs_give_leases_waits_and_decisions():
    who = "INFO rfork.pull.planner_session: rank 0:"
    text = (
        f"2026-11-28 03:46:10,100 {who} every seed busy; asking again in 2.50 s\n"
        f"2026-11-28 03:46:12,700 {who} assigned abc123 (1 candidate(s))\n"
        "garbage line\n"
    )
    parsed = parse_instance_log(text)
    assert [w for _, w in parsed["waits"]] == [2.5]
    assert [s for _, s in parsed["leases"]] == ["abc123"]
    assert parsed["leases"][0][0] - parsed["waits"][0][0] == pytest.approx(2.6)
    plog = "2026-11-28 03:46:12,700 DEBUG planner.decisions: lease node=h01 rank=0\nother\n"
    (d,) = parse_planner_log(plog, go=parsed["leases"][0][0] - 1.0)
    assert d == {"t": 1.0, "decision": "lease node=h01 rank=0"}


def test_cpu_summary_marks_a_saturated_run():
    cpu = CpuSampler()
    cpu.samples = [(float(t), 0.99 if t < 6 else 0.2) for t in range(10)]
    s = cpu.summary(0, 9)
    assert s["saturated"]
    assert s["saturated_share"] == pytest.approx(0.6)
    assert not cpu.summary(6, 9)["saturated"]
    assert cpu.summary(20, 30)["samples"] == 0


def test_the_simulator_is_given_the_real_loaders_order_of_first_asks_in_their_racks():
    from bench.fleet.compare import ask_order

    # four loaders on h01..h04 (one seed on h00), two racks: loader j is in rack (j + 1) % 2
    rows: list[dict[str, float | None]] = [{"first_ask": t} for t in (0.4, 0.1, 0.3, 0.2)]
    doc = {"config": {"seeds": 1, "racks": 2}, "instances": rows}
    order = ask_order(doc)
    assert order == [2, 0, 3, 1]  # loaders 1, 3, 2, 0 asked in that order
    assert all(i % 2 == (j + 1) % 2 for i, j in zip(order, (1, 3, 2, 0), strict=True))  # each keeps its rack
    rows[0] = {"first_ask": None}
    assert ask_order(doc) is None
