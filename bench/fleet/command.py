"""`rfork bench fleet SCENARIO`: a fleet of emulated hosts (network namespaces) on this machine.

Scenarios:
- scale-out: N loaders from one seed by the load-aware tree, by first-seed-only, and all from the
  storage host (each a fresh fleet, in that order);
- racks: 2 racks, uplink = one host NIC, the tree with and without rack hold;
- faults: during a tree scale-out from two seeds, a seed's link cut, a seed SIGKILLed, the planner
  restarted, 1 % loss on one rack;
- smoke: 3 loaders, a small model, a seed SIGKILLed (the CI test).
Each prints a table, writes `--json` and a timeline PNG per run (`--plot-dir`), and beside every
tree / first-seed / storage run the simulator's prediction from the same parameters. Needs root on
Linux (namespaces, veth, tc); every namespace is removed on exit, on Ctrl-C, and at the next start
after a killed run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
from pathlib import Path
from typing import Any

SCENARIOS = ("scale-out", "racks", "faults", "smoke")


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork bench fleet`."""
    parser.add_argument("scenario", choices=SCENARIOS, help="what to run")
    parser.add_argument("--loaders", type=int, default=None, help="loaders (default 8; racks 16; faults 6)")
    parser.add_argument("--model-gb", type=float, default=0.5, help="model size, GB (default 0.5)")
    parser.add_argument(
        "--nic-mbit", type=float, default=500.0, help="host NIC, Mbit/s each way (default 500)"
    )
    parser.add_argument("--storage-mbit", type=float, default=None, help="storage link (default: one NIC)")
    parser.add_argument("--max-pulls", type=int, default=2, help="pull limit per seed (default 2)")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=None,
        help="scale-out: tree first-seed storage; racks: hold no-hold; "
        "faults: cut kill planner-restart loss (default all)",
    )
    parser.add_argument("--timeout", type=float, default=400.0, help="bound per run, seconds (default 400)")
    parser.add_argument("--no-sim", action="store_true", help="skip the simulator's prediction")
    parser.add_argument("--plot-dir", type=Path, default=None, help="write a timeline PNG per run here")
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep each run's work directory (logs)")
    parser.add_argument(
        "--shm-pair",
        action="store_true",
        help="the first seed's host also runs an instance that loads over shm (tcp across hosts)",
    )
    parser.add_argument(
        "--ui-port",
        type=int,
        default=0,
        help="forward each run's fleet page to http://127.0.0.1:PORT/ui while it runs (default: off)",
    )


def _runs(args: argparse.Namespace) -> list[tuple[str, Any, str, tuple[Any, ...]]]:
    """(label, FleetConfig, mode, faults) per run of the scenario."""
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from bench.fleet import faults
    from bench.fleet.run import FleetConfig

    size = int(args.model_gb * 1e9)
    common = {
        "planner_port_ui": args.ui_port,
        "shm_pair": args.shm_pair,
        "model_bytes": size,
        "nic_mbit": args.nic_mbit,
        "max_pulls": args.max_pulls,
        "storage_mbit": args.storage_mbit,
        "timeout_s": args.timeout,
    }
    if args.scenario == "scale-out":
        cfg = FleetConfig(loaders=args.loaders or 8, **common)
        return [(m, cfg, m, ()) for m in (args.modes or ["tree", "first-seed", "storage"])]
    out: list[tuple[str, Any, str, tuple[Any, ...]]] = []
    if args.scenario == "racks":
        for m in args.modes or ["hold", "no-hold"]:
            cfg = FleetConfig(
                loaders=args.loaders or 16,
                racks=2,
                uplink_mbit=args.nic_mbit,
                rack_hold=m == "hold",
                **common,
            )
            out.append((f"tree, {m}", cfg, "tree", ()))
        return out
    names = ["kill"] if args.scenario == "smoke" else list(args.modes or faults.FAULTS)
    loaders = args.loaders or (3 if args.scenario == "smoke" else 6)
    out = []
    for name in names:
        cfg = faults.config(
            name, loaders=loaders, model_bytes=size, nic_mbit=args.nic_mbit, timeout_s=args.timeout
        )
        cfg = dataclasses.replace(cfg, planner_port_ui=args.ui_port)
        out.append((f"fault: {name}", cfg, "tree", faults.faults_for(name)))
    return out


def run(args: argparse.Namespace) -> int:
    """Run the scenario's fleets one after another; table, JSON, plots."""
    from rich.console import Console

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from bench.fleet.compare import agreement, simulate
    from bench.fleet.network import can_make_namespaces
    from bench.fleet.report import plot_timeline, summarise
    from bench.fleet.run import run_fleet

    console = Console()
    console.width = max(console.width, 150)  # the table has nine columns
    why = can_make_namespaces()
    if why is not None:
        raise RuntimeError(f"the fleet harness cannot run here: {why}")
    results = []
    for label, cfg, mode, faults in _runs(args):
        with console.status(f"{label}: starting") as status:

            def progress(msg: str, lb: str = label, st: Any = status, ui: int = cfg.planner_port_ui) -> None:
                if ui and msg.startswith("planner host"):
                    console.print(f"{lb}: the fleet page at http://127.0.0.1:{ui}/ui while it runs")
                st.update(f"{lb}: {msg}")

            doc = run_fleet(cfg, mode, faults=faults, keep=args.keep, progress=progress)
        doc["label"] = label
        doc["summary"] = summarise(doc)
        if not args.no_sim and not faults:
            with console.status(f"{label}: the simulator with the same parameters"):
                doc["simulated"] = simulate(doc)
            doc["simulated"]["vs_real"] = agreement(doc["all_ready_s"], doc["simulated"]["predicted_s"])
        if args.plot_dir is not None:
            args.plot_dir.mkdir(parents=True, exist_ok=True)
            name = (
                f"fleet-{args.scenario}-{label.replace(', ', '-').replace(': ', '-').replace(' ', '-')}.png"
            )
            doc["plot"] = str(args.plot_dir / name)
            plot_timeline(doc, args.plot_dir / name, title=_title(doc))
        results.append(doc)
        s = doc["summary"]
        console.print(
            f"{label}: all ready {s['all_ready_s']} s, verified {s['verified']}"
            + (f", failed {s['failed']}" if s["failed"] else "")
        )
    out = {
        "scenario": args.scenario,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "runs": results,
    }
    out["goals"] = goals(args.scenario, results)
    console.print(_table(args.scenario, results))
    for g in out["goals"]:
        console.print(f"goal: {g['goal']}: {g['value']} -> {'met' if g['met'] else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, allow_nan=False))
    return 0


def _title(doc: dict[str, Any]) -> str:
    c = doc["config"]
    racks = f", {c['racks']} racks, uplink {c['uplink_mbit']:g} Mbit/s" if c["racks"] else ""
    return (
        f"{doc['label']}: {c['loaders']} loaders, {c['model_bytes'] / 1e9:g} GB, "
        f"{c['nic_mbit']:g} Mbit/s NICs{racks}; all ready {doc['all_ready_s']} s"
    )


def _table(scenario: str, results: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from bench.fleet.report import ideal_tree_s

    table = Table(title=f"fleet on emulated hosts: {scenario} (seconds after the start signal)")
    for col in (
        "run",
        "all ready s",
        "× ideal tree",
        "simulated s (Δ)",
        "sources",
        "max pulls/seed",
        "429 re-asks",
        "verified",
        "CPU busy (saturated?)",
    ):
        table.add_column(col, justify="left" if col in ("run", "sources") else "right")
    for doc in results:
        c, s = doc["config"], doc["summary"]
        ideal = ideal_tree_s(c["loaders"], c["model_bytes"], c["nic_mbit"])
        ready = s["all_ready_s"]
        sim = doc.get("simulated")
        table.add_row(
            doc["label"],
            "-" if ready is None else f"{ready:.1f}",
            "-" if ready is None else f"{ready / ideal:.2f}",
            "-"
            if sim is None
            else f"{sim['predicted_s']:.1f} ({sim['vs_real']:+.0%})"
            if sim["vs_real"] is not None
            else "-",
            ", ".join(f"{k} {v}" for k, v in s["from"].items()),
            str(s["max_pulls_per_seed"]),
            str(s["asked_again"]),
            s["verified"],
            f"{s['cpu_mean_busy']:.0%} ({'yes' if s['cpu_saturated'] else 'no'})"
            if s["cpu_mean_busy"] is not None
            else "-",
        )
    return table


def goals(scenario: str, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals that this scenario's runs decide."""
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from bench.fleet.report import ideal_rack_tree_s, ideal_tree_s, transfer_s

    out: list[dict[str, Any]] = []
    by_mode = {d["label"]: d for d in results}
    for d in results:
        sim = d.get("simulated")
        if sim and sim["vs_real"] is not None:
            out.append(
                {
                    "goal": f"{d['label']}: simulator within 15 % of real",
                    "value": f"{sim['vs_real']:+.1%}",
                    "met": abs(sim["vs_real"]) <= 0.15,
                }
            )
    if scenario == "scale-out" and "tree" in by_mode:
        c = by_mode["tree"]["config"]
        ideal = ideal_tree_s(c["loaders"], c["model_bytes"], c["nic_mbit"])
        tree = by_mode["tree"]["all_ready_s"]
        if tree:
            out.append(
                {
                    "goal": f"tree <= 1.25x ideal doubling tree ({ideal:.1f} s)",
                    "value": f"{tree / ideal:.2f}x",
                    "met": tree / ideal <= 1.25,
                }
            )
        if tree and "storage" in by_mode and by_mode["storage"]["all_ready_s"]:
            storage_mbit = c["storage_mbit"] or c["nic_mbit"]
            ideal_speedup = c["loaders"] * transfer_s(c["model_bytes"], storage_mbit) / ideal
            speedup = by_mode["storage"]["all_ready_s"] / tree
            out.append(
                {
                    "goal": f"speed-up over storage >= 0.8 of ideal ({ideal_speedup:.2f}x)",
                    "value": f"{speedup:.2f}x ({speedup / ideal_speedup:.2f} of ideal)",
                    "met": speedup >= 0.8 * ideal_speedup,
                }
            )
    if scenario == "racks":
        for d in results:
            c = d["config"]
            if not c["rack_hold"] or not d["all_ready_s"]:
                continue
            hosts = c["seeds"] + c["loaders"]
            per_rack = [
                sum(1 for i in range(c["seeds"], hosts) if i % c["racks"] == r) for r in range(c["racks"])
            ]
            ideal = ideal_rack_tree_s(per_rack, c["model_bytes"], c["nic_mbit"], c["uplink_mbit"])
            out.append(
                {
                    "goal": f"{d['label']}: within 1.25x ideal rack-aware tree ({ideal:.1f} s)",
                    "value": f"{d['all_ready_s'] / ideal:.2f}x",
                    "met": d["all_ready_s"] / ideal <= 1.25,
                }
            )
    if scenario in ("faults", "smoke"):
        for d in results:
            ok = all(r["ok"] and r["verified"] for r in d["instances"]) or all(
                r["ok"] or r.get("error") for r in d["instances"]
            )
            out.append(
                {
                    "goal": f"{d['label']}: every loader verified or failed with a clear error",
                    "value": d["summary"]["verified"] + (f", failed {d['failed']}" if d["failed"] else ""),
                    "met": ok and not d["timed_out"],
                }
            )
    return out
