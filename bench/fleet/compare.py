"""The simulator's prediction for a real fleet run: `rfork simulate scale-out` with the run's parameters.

The same NIC, uplink, storage link, model size and pull limit, and the overhead measured in the run
(each pull's time to verified minus its bytes at the NIC rate, median over the run's pulls), given to
bench.simulate (the real planner on a flow model). Rates are given as the payload's share of the
shaped rate (TCP_PAYLOAD_SHARE): with the shaped rates themselves, every storage and first-seed run
was 6-7 % slower than predicted, which the headers' share (4.4 %) mostly explains. Storage is the
simulator's hub baseline. The simulated loaders first ask in the order the real ones did (each
mapped to a simulated loader in the same rack): with racks, which loaders reach the head of the line
first decides which pulls cross the spine together.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.fleet.report import transfer_s

# htb shapes whole frames (14-byte Ethernet + 20-byte IP + 32-byte TCP headers with timestamps around
# 1448 bytes of payload): the bytes a pull or a download moves get this share of a shaped rate.
TCP_PAYLOAD_SHARE = 1448 / 1514


def measured_overhead_s(doc: dict[str, Any]) -> float:
    """Median of (pull started -> verified) - bytes / NIC over the run's solo-rate pulls from seeds.

    Only pulls that ran alone on their seed count (the first generation's, or any under solo pulls):
    the rest of a shared pull's time is the sharing, which the simulator models itself.
    """
    cfg = doc["config"]
    t = transfer_s(cfg["model_bytes"], cfg["nic_mbit"] * TCP_PAYLOAD_SHARE)
    spans = [
        (r["ready_s"] - r["pull_started"]) - t
        for r in doc["instances"]
        if r.get("ok") and r.get("pull_started") is not None and r.get("source") != "disk"
    ]
    solo = [s for s in spans if s < 0.5 * t]
    return max(0.0, statistics.median(solo)) if solo else 0.0


def simulate(doc: dict[str, Any], *, overhead_s: float | None = None) -> dict[str, Any]:
    """The simulator's all-ready time for the run's mode and parameters (seconds after the start)."""
    # imported here: the simulator imports the planner (SQLAlchemy); `rfork bench --help` must stay
    # light (start-up time)
    from bench.simulate.fleet import FleetSim, hub_baseline, migrated_template
    from bench.simulate.model import SCENARIOS, BandwidthModel

    cfg = doc["config"]
    overhead = measured_overhead_s(doc) if overhead_s is None else overhead_s
    storage_mbit = cfg["storage_mbit"] if cfg["storage_mbit"] is not None else cfg["nic_mbit"]
    share = TCP_PAYLOAD_SHARE  # the simulator's rates are what the payload gets
    model = BandwidthModel(
        model_gb=cfg["model_bytes"] / 1e9,
        nic_gbit_s=cfg["nic_mbit"] * share / 1e3,
        max_concurrent_pulls=cfg["max_pulls"],
        disk_gbyte_s=1e-3,  # no local copy: a loader never falls back (the run's loaders have none)
        hub_gbit_s=storage_mbit * share / 1e3,
        racks=cfg["racks"],
        uplink_gbit_s=(cfg["uplink_mbit"] * share or 1e6) / 1e3,
        ready_overhead_s=overhead,
    )
    n = cfg["loaders"]
    if doc["mode"] == "storage":
        return {"predicted_s": round(hub_baseline(model, n), 3), "overhead_s": round(overhead, 3)}
    scenario = SCENARIOS["tree-load-aware" if doc["mode"] == "tree" else "first-seed-only"]
    order = ask_order(doc)
    with tempfile.TemporaryDirectory(prefix="rfork-fleet-sim-") as tmp:
        res = FleetSim(
            model=model,
            scenario=scenario,
            instances=n,
            template=migrated_template(Path(tmp)),
            workdir=Path(tmp),
            rack_hold=bool(cfg["rack_hold"]) and cfg["racks"] > 0,
            ask_order=order,
        ).run()
    return {
        "predicted_s": round(res.all_ready_s, 3),
        "overhead_s": round(overhead, 3),
        "from_seed": res.sources["seed"],
        "from_disk": res.sources["disk"],
    }


def ask_order(doc: dict[str, Any]) -> list[int] | None:
    """Simulated loader indices in the order the real loaders first asked; None without that record.

    Real loader j runs on host j + seeds, in rack (j + seeds) % racks; simulated loader i is in rack
    i % racks; so j maps to (j + seeds) % n, which keeps each loader's rack when n is a multiple of racks.
    """
    cfg = doc["config"]
    rows = doc["instances"]
    n, seeds = len(rows), cfg["seeds"]
    if any(r.get("first_ask") is None for r in rows):
        return None
    real = sorted(range(n), key=lambda j: rows[j]["first_ask"])
    order = [(j + seeds) % n for j in real]
    return order if sorted(order) == list(range(n)) else None


def agreement(real_s: float | None, predicted_s: float) -> float | None:
    """predicted / real - 1 (None when the run did not finish)."""
    if not real_s:
        return None
    return round(predicted_s / real_s - 1.0, 3)
