"""Scale-out burst: one seed, then N loader processes at once; the tree against disk and one seed only.

Three modes, each on a fresh planner and seed, measured in the same run:
- tree: loaders become seeds once verified, so later loaders pull from earlier ones;
- first-seed: loaders exit after loading (the tree disabled): all N pull from the first seed;
- disk: all N read the checkpoint at once, no planner.
Each loader is a real `rfork load` process. Time to all ready runs from the first spawn to the last
loader's verified weights. The tree (who pulled from whom) comes from the loaders' own reports, and
the leases recorded by the planner give the most pulls any seed served at once.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MODES = ("tree", "first-seed", "disk")


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork bench scale-out`."""
    parser.add_argument(
        "--instances", type=int, default=8, help="loader processes started at once (default 8)"
    )
    parser.add_argument(
        "--size-gib", type=float, default=0.25, help="synthetic checkpoint size (default 0.25)"
    )
    parser.add_argument(
        "--max-concurrent-pulls",
        "--max-pulls",
        dest="max_pulls",
        type=int,
        default=2,
        help="pull limit of every seed (default 2)",
    )
    parser.add_argument(
        "--modes", nargs="+", default=list(MODES), choices=MODES, help="what to run (default all three)"
    )
    parser.add_argument(
        "--fallback-gbps",
        type=float,
        default=0.0,
        help="loaders' disk-rate estimate the planner weighs against waiting (default 0: always wait)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per mode (default 900)")
    parser.add_argument(
        "--planner-port",
        type=int,
        default=0,
        help="port of each mode's planner (default 0: a free one); set it to watch the burst on the "
        "planner's fleet page, http://127.0.0.1:PORT/ui (the planner runs without auth: any token shows it)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")


def max_concurrent(intervals: Sequence[tuple[float, float]]) -> int:
    """Most intervals open at one instant (an interval ending when another starts does not overlap it)."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = cur = 0
    for _, step in points:
        cur += step
        best = max(best, cur)
    return best


def run_burst(
    *,
    mode: str,
    instances: int,
    checkpoint: Path,
    workdir: Path,
    max_pulls: int,
    fallback_gbps: float = 0.0,
    timeout_s: float = 900.0,
    planner_port: int = 0,
) -> dict[str, Any]:
    """One mode: planner + seed (unless disk), then `instances` loader processes at once; the outcome."""
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from bench.processes import Fleet, load_args, seed_args
    from planner import PlannerServer
    from planner.contract import PlannerClient

    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of {MODES}")
    workdir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(workdir / "procs")
    try:
        with PlannerServer(
            db_url=f"sqlite:///{workdir / 'planner.db'}", insecure=True, port=planner_port
        ) as planner:
            seed_ids: list[str] = []
            if mode != "disk":
                ready = workdir / "seed.json"
                seed = fleet.spawn(
                    "seed",
                    seed_args(
                        checkpoint, planner.url, ready, extra=["--max-concurrent-pulls", str(max_pulls)]
                    ),
                )
                seed_ids = list(fleet.wait_file(seed, ready, timeout_s=timeout_s)["instance_ids"])
            outs = [workdir / f"loader-{i}.json" for i in range(instances)]
            extra = ["--max-concurrent-pulls", str(max_pulls), "--fallback-gbps", str(fallback_gbps)]
            t0 = time.time()
            children = [
                fleet.spawn(
                    f"loader-{i}",
                    load_args(
                        outs[i],
                        planner_url=None if mode == "disk" else planner.url,
                        checkpoint=checkpoint,
                        then="serve" if mode == "tree" else "exit",
                        extra=extra,
                    ),
                )
                for i in range(instances)
            ]
            deadline = time.monotonic() + timeout_s
            results = [
                fleet.wait_file(c, o, timeout_s=max(1.0, deadline - time.monotonic()))
                for c, o in zip(children, outs, strict=True)
            ]
            with PlannerClient(planner.url) as client:
                leases = [t.model_dump() for t in client.transfers(limit=1000).items]
    finally:
        fleet.close()
    return summarize(mode=mode, t0=t0, results=results, seed_ids=seed_ids, leases=leases, max_pulls=max_pulls)


def summarize(
    *,
    mode: str,
    t0: float,
    results: Sequence[dict[str, Any]],
    seed_ids: Sequence[str],
    leases: Sequence[dict[str, Any]],
    max_pulls: int,
) -> dict[str, Any]:
    """Times, sources, the tree (loader -> parent) and the most concurrent pulls per seed."""
    names = dict.fromkeys(seed_ids, "seed")
    for i, r in enumerate(results):
        for iid in r.get("instance_ids") or []:
            names[iid] = f"L{i}"
    tree = []
    for i, r in enumerate(results):
        last = r["attempts"][-1] if r.get("attempts") else {}
        parent = last.get("instance_id")
        tree.append(
            {
                "loader": f"L{i}",
                "from": names.get(parent, parent) if parent else last.get("source", r["source"]),
                "source": r["source"],
                "ready_s": round(r["verified_at"] - t0, 3),
                "load_s": round(r["seconds"], 3),
                "verified": bool(r["verified"]),
            }
        )
    per_seed: dict[str, list[tuple[float, float]]] = {}
    for lease in leases:
        if lease.get("ended_at") is not None:
            per_seed.setdefault(lease["seed_id"], []).append((lease["created_at"], lease["ended_at"]))
    concurrency = {names.get(s, s): max_concurrent(iv) for s, iv in per_seed.items()}
    loads = [t["load_s"] for t in tree]
    first_load = min(r["verified_at"] - r["seconds"] for r in results)
    last_ready = max(r["verified_at"] for r in results)
    return {
        "mode": mode,
        "instances": len(results),
        "all_ready_s": round(last_ready - t0, 3),
        # first loader starting its load -> last one verified: the burst without process start-up
        "load_window_s": round(last_ready - first_load, 3),
        "load_s": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
        "sources": {s: sum(1 for t in tree if t["source"] == s) for s in sorted({t["source"] for t in tree})},
        "verified": all(t["verified"] for t in tree),
        "tree": tree,
        "max_pulls_per_seed": concurrency,
        "leases": [
            {
                "seed": names.get(x["seed_id"], x["seed_id"]),
                "start_s": round(x["created_at"] - t0, 3),
                "end_s": round(x["ended_at"] - t0, 3) if x.get("ended_at") is not None else None,
                "outcome": x.get("outcome"),
            }
            for x in sorted(leases, key=lambda x: x["created_at"])
        ],
        "max_pulls": max_pulls,
        "within_limit": all(c <= max_pulls for c in concurrency.values()),
    }


def run(args: argparse.Namespace) -> int:
    """Write the checkpoint, run each mode, print the table and the tree."""
    if args.instances < 1 or args.size_gib <= 0 or args.max_pulls < 1:
        raise ValueError("--instances and --max-concurrent-pulls must be >= 1 and --size-gib positive")
    from rich.console import Console
    from rich.table import Table

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from rfork.weights.synthetic import write_synthetic_checkpoint

    console = Console(width=max(Console().width, 120))
    os.environ.setdefault("RFORK_TCP_HOST", "127.0.0.1")
    workdir = Path(tempfile.mkdtemp(prefix="rfork-scaleout-"))
    modes: dict[str, dict[str, Any]] = {}
    try:
        with console.status("writing the synthetic checkpoint"):
            ckpt = write_synthetic_checkpoint(
                workdir / "checkpoint", size_bytes=int(args.size_gib * (1 << 30))
            )
        nbytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        if args.planner_port:
            url = f"http://127.0.0.1:{args.planner_port}/ui"
            console.print(f"fleet page: {url} (each mode's planner, no auth)")
        for mode in args.modes:
            with console.status(f"{mode}: {args.instances} loaders at once"):
                modes[mode] = run_burst(
                    mode=mode,
                    instances=args.instances,
                    checkpoint=ckpt,
                    workdir=workdir / mode,
                    max_pulls=args.max_pulls,
                    fallback_gbps=args.fallback_gbps,
                    timeout_s=args.timeout,
                    planner_port=args.planner_port,
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    base = modes.get("disk", {}).get("load_window_s")
    table = Table(
        title=f"scale-out burst: {args.instances} loaders at once, {nbytes / 1e9:.2f} GB, "
        f"limit {args.max_pulls} pulls per seed"
    )
    for col in ("mode", "ready s", "window s", "load s min/med/max", "sources", "pulls/seed", "× disk", "ok"):
        table.add_column(col, justify="left" if col in ("mode", "sources") else "right")
    for mode, r in modes.items():
        ls = r["load_s"]
        ratio = r["load_window_s"] / base if base else None
        r["vs_disk"] = round(ratio, 3) if ratio is not None else None
        table.add_row(
            mode,
            f"{r['all_ready_s']:.2f}",
            f"{r['load_window_s']:.2f}",
            f"{ls['min']:.2f}/{ls['median']:.2f}/{ls['max']:.2f}",
            ", ".join(f"{k} {v}" for k, v in r["sources"].items()),
            str(max(r["max_pulls_per_seed"].values(), default=0)),
            f"{ratio:.2f}" if ratio is not None else "-",
            "yes" if r["verified"] else ("no digests" if mode == "disk" else "NO"),
        )
    console.print(table)
    if "tree" in modes:
        edges = ", ".join(
            f"{t['loader']}←{t['from']}" for t in sorted(modes["tree"]["tree"], key=lambda t: t["ready_s"])
        )
        console.print(f"tree (in order of ready): {edges}")
    console.print(
        "ready s: first spawn -> last loader verified (includes process start-up); window s: first load "
        "started -> last verified; × disk: window / the same for all N from disk at once (same run)"
    )
    if args.json:
        doc = {
            "instances": args.instances,
            "model_bytes": nbytes,
            "max_pulls": args.max_pulls,
            "load_average": list(os.getloadavg()),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "modes": modes,
        }
        args.json.write_text(json.dumps(doc, indent=1, allow_nan=False))
    return 0
