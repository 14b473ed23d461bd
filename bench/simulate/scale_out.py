"""Simulate a scale-out burst: the real planner's decisions on a bandwidth model, against the ideal tree."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.simulate.model import SCENARIOS, BandwidthModel


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork simulate scale-out`."""
    d = BandwidthModel()
    parser.add_argument("--instances", type=int, default=1000, help="loaders in the burst (default 1000)")
    parser.add_argument(
        "--points",
        type=int,
        nargs="*",
        default=None,
        help="fleet sizes for the curve (default: powers of two below --instances, then --instances)",
    )
    parser.add_argument(
        "--scenarios",
        nargs="+",
        default=list(SCENARIOS),
        choices=list(SCENARIOS),
        help="planner policies to run (default all)",
    )
    parser.add_argument("--model-gb", type=float, default=d.model_gb, help="bytes per instance, GB")
    parser.add_argument("--nic-gbit", type=float, default=d.nic_gbit_s, help="NIC per node, Gbit/s")
    parser.add_argument(
        "--max-concurrent-pulls",
        "--max-pulls",
        dest="max_pulls",
        type=int,
        default=d.max_concurrent_pulls,
        help="pull limit per seed",
    )
    parser.add_argument(
        "--disk-gbyte", type=float, default=d.disk_gbyte_s, help="local disk per node, GB/s (fallback)"
    )
    parser.add_argument("--hub-gbit", type=float, default=d.hub_gbit_s, help="hub egress, Gbit/s in all")
    parser.add_argument("--racks", type=int, default=d.racks, help="racks (0: flat network)")
    parser.add_argument(
        "--uplink-gbit", type=float, default=d.uplink_gbit_s, help="rack uplink per direction, Gbit/s"
    )
    parser.add_argument(
        "--overhead-s", type=float, default=d.ready_overhead_s, help="pull done -> READY, seconds"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of the curves here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table as Markdown here")


def points_for(instances: int, points: list[int] | None) -> list[int]:
    """Fleet sizes of the curve: the given ones, else 1, 2, 4, ... below `instances`, then `instances`."""
    if points:
        return sorted(set(points))
    out, p = [], 1
    while p < instances:
        out.append(p)
        p *= 2
    return [*out, instances]


def run(args: argparse.Namespace) -> int:
    """Run every scenario at every fleet size; print the table; JSON, PNG and Markdown on request."""
    from rich.console import Console
    from rich.table import Table

    # imported here: `rfork simulate --help` imports this module, which must stay light (start-up time);
    # the simulator imports the planner (SQLAlchemy)
    from bench.simulate.fleet import FleetSim, hub_baseline, migrated_template

    if args.instances < 1:
        raise ValueError("--instances must be >= 1")
    model = BandwidthModel(
        model_gb=args.model_gb,
        nic_gbit_s=args.nic_gbit,
        max_concurrent_pulls=args.max_pulls,
        disk_gbyte_s=args.disk_gbyte,
        hub_gbit_s=args.hub_gbit,
        racks=args.racks,
        uplink_gbit_s=args.uplink_gbit,
        ready_overhead_s=args.overhead_s,
    )
    console = Console()
    sizes = points_for(args.instances, args.points)
    workdir = Path(tempfile.mkdtemp(prefix="rfork-sim-"))
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    try:
        template = migrated_template(workdir)
        for n in sizes:
            row: dict[str, Any] = {
                "instances": n,
                "ideal_tree_s": round(model.ideal_tree_s(n), 3),
                "all_from_hub_s": round(hub_baseline(model, n), 3),
                "all_from_disk_s": round(model.disk_s(), 3),
            }
            for name in args.scenarios:
                with console.status(f"{name}, {n} instances"):
                    res = FleetSim(
                        model=model, scenario=SCENARIOS[name], instances=n, template=template, workdir=workdir
                    ).run()
                row[name] = {
                    "all_ready_s": round(res.all_ready_s, 3),
                    "vs_ideal": round(res.all_ready_s / row["ideal_tree_s"], 3),
                    "from_seed": res.sources["seed"],
                    "from_disk": res.sources["disk"],
                    "max_pulls_per_seed": res.max_pulls_per_seed,
                    "planner_calls": res.planner_calls,
                    "busy_answers": res.busy_answers,
                    "wall_s": round(res.wall_s, 2),
                    # the real planner's own time per assignment decision (lease or 429) at this size
                    "ms_per_decision": round(res.decision_s / max(1, res.decisions_made) * 1e3, 3),
                }
            rows.append(row)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    doc = {
        "model": asdict(model),
        "scenarios": args.scenarios,
        "rows": rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    console.print(_table(Table, doc))
    last = rows[-1]
    goal = last.get("tree-load-aware")
    if goal is not None:
        console.print(
            f"{last['instances']} instances: tree (load-aware) {goal['all_ready_s']:.1f} s = "
            f"{goal['vs_ideal']:.2f}x the ideal tree ({last['ideal_tree_s']:.1f} s); all from the hub "
            f"{last['all_from_hub_s']:.1f} s; goal <= 1.5x: {'met' if goal['vs_ideal'] <= 1.5 else 'NOT met'}"
            f"; planner {goal['ms_per_decision']:.2f} ms per decision ({goal['wall_s']:.0f} s in all)"
        )
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1, allow_nan=False))
    if args.markdown:
        args.markdown.write_text(markdown_table(doc))
    if args.plot:
        plot(doc, args.plot)
    return 0


def _table(table_cls: Any, doc: dict[str, Any]) -> Any:
    m = doc["model"]
    table = table_cls(
        title=f"simulated burst: {m['model_gb']:g} GB per instance, {m['nic_gbit_s']:g} Gbit/s NICs, "
        f"limit {m['max_concurrent_pulls']} pulls per seed; seconds to all READY (× ideal tree)"
    )
    table.add_column("N", justify="right")
    table.add_column("ideal tree", justify="right")
    for name in doc["scenarios"]:
        table.add_column(name, justify="right")
    table.add_column("all from hub", justify="right")
    for r in doc["rows"]:
        cells = [str(r["instances"]), f"{r['ideal_tree_s']:.1f}"]
        cells += [f"{r[s]['all_ready_s']:.1f} ({r[s]['vs_ideal']:.2f}×)" for s in doc["scenarios"]]
        cells.append(f"{r['all_from_hub_s']:.1f}")
        table.add_row(*cells)
    return table


def markdown_table(doc: dict[str, Any]) -> str:
    """The result table as Markdown (seconds to all READY, × the ideal tree, fallbacks to disk)."""
    head = ["N", "ideal tree s", *doc["scenarios"], "all from hub s", "all from disk s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in doc["rows"]:
        cells = [str(r["instances"]), f"{r['ideal_tree_s']:.1f}"]
        for s in doc["scenarios"]:
            c = r[s]
            disk = f", {c['from_disk']} disk" if c["from_disk"] else ""
            cells.append(f"{c['all_ready_s']:.1f} ({c['vs_ideal']:.2f}×{disk})")
        cells += [f"{r['all_from_hub_s']:.1f}", f"{r['all_from_disk_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """Time to all READY against N, log-x, one line per scenario plus the ideal tree and the hub."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib (pip install 'rfork[dev]')") from exc
    rows = doc["rows"]
    xs = [r["instances"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in doc["scenarios"]:
        ax.plot(xs, [r[name]["all_ready_s"] for r in rows], marker="o", label=name)
    ax.plot(xs, [r["ideal_tree_s"] for r in rows], "k--", label="ideal tree (log2 doubling)")
    ax.plot(xs, [1.5 * r["ideal_tree_s"] for r in rows], "k:", label="1.5 × ideal")
    ax.plot(xs, [r["all_from_hub_s"] for r in rows], color="grey", label="all from hub")
    disk = [r["all_from_disk_s"] for r in rows]
    ax.plot(xs, disk, color="brown", linestyle="-.", label="each from own disk")
    m = doc["model"]
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="instances in the burst (N)",
        ylabel="seconds until all READY",
        title=f"{m['model_gb']:g} GB, {m['nic_gbit_s']:g} Gbit/s NICs, "
        f"{m['max_concurrent_pulls']} pulls/seed",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
