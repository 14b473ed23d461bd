"""Cold start per source: time from process start to weights verified, against same-run baselines.

Baselines measured in the same run: one memcpy of the model's bytes, and for each one-sided provider
the transport's own large-read GB/s (`rfork.bench.transport.large_read_gbps`: the loader's read size
and depth, pre-faulted memory). Pull efficiency = load GB/s / that transport GB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

ALL_SOURCES = ("disk", "rfork-tcp", "rfork-shm", "nccl")


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork bench cold-start`."""
    parser.add_argument(
        "--size-gib", type=float, default=1.0, help="synthetic checkpoint size (default 1 GiB)"
    )
    parser.add_argument(
        "--sources",
        nargs="+",
        default=["disk", "rfork-tcp", "rfork-shm"],
        choices=ALL_SOURCES,
        help="what to measure (default disk rfork-tcp rfork-shm)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per source; the median is reported")
    parser.add_argument(
        "--drop-caches",
        action="store_true",
        help="drop the page cache before each disk run (needs root; else the cache stays warm)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")


def memcpy_seconds(nbytes: int, repeat: int = 3) -> float:
    """The physical baseline: one memcpy of `nbytes` between two pre-faulted buffers (best of `repeat`)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst.fill_(0)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def _median_phases(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds per load phase over the runs (phases a run lacks count as 0)."""
    names = sorted({k for r in runs for k in r.get("phases", {})})
    return {
        k: round(statistics.median(float(r.get("phases", {}).get(k, 0.0)) for r in runs), 4) for k in names
    }


def _drop_caches() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        subprocess.run(["sync"], check=False, timeout=60)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    """Set up planner + seed, run `--repeat` fresh loader processes per source, print the table."""
    if args.size_gib <= 0 or args.repeat < 1:
        raise ValueError("--size-gib must be positive and --repeat >= 1")
    from rich.console import Console
    from rich.table import Table

    from planner.server import PlannerServer
    from rfork.bench.transport import large_read_gbps
    from rfork.checkpoint import write_synthetic_checkpoint
    from rfork.harness import Fleet, available_providers, load_args, seed_args

    console = Console()
    os.environ.setdefault("RFORK_TCP_HOST", "127.0.0.1")
    workdir = Path(tempfile.mkdtemp(prefix="rfork-coldstart-"))
    fleet = Fleet(workdir)
    try:
        with console.status("writing the synthetic checkpoint"):
            ckpt = write_synthetic_checkpoint(
                workdir / "checkpoint", size_bytes=int(args.size_gib * (1 << 30))
            )
        wanted = [s.removeprefix("rfork-") for s in args.sources if s.startswith("rfork-")]
        providers, skipped = available_providers(wanted)
        for s in skipped:
            console.print(f"[yellow]skipping {s}[/yellow]")
        sources = [
            s for s in args.sources if not s.startswith("rfork-") or s.removeprefix("rfork-") in providers
        ]
        results: dict[str, list[dict[str, Any]]] = {s: [] for s in sources}
        cache_state = "warm (just written)"
        with PlannerServer(db_url=f"sqlite:///{workdir / 'planner.db'}", insecure=True) as planner:
            ready = workdir / "seed.json"
            seed = fleet.spawn("seed", seed_args(ckpt, planner.url, ready, providers=providers or ["tcp"]))
            info = fleet.wait_file(seed, ready, timeout_s=600)
            model, nbytes = info["identity"]["model"], int(info["bytes"])
            for rep in range(args.repeat):
                for source in sources:
                    out = workdir / f"{source}-{rep}.json"
                    if source == "disk":
                        largs = load_args(out, planner_url=None, checkpoint=ckpt)
                        if args.drop_caches:
                            cache_state = (
                                "dropped before each disk run"
                                if _drop_caches()
                                else ("warm (drop_caches needs root)")
                            )
                    else:
                        prov = "nccl" if source == "nccl" else source.removeprefix("rfork-")
                        largs = load_args(out, planner_url=planner.url, checkpoint_id=model, providers=[prov])
                    with console.status(f"{source} run {rep + 1}/{args.repeat}"):
                        child = fleet.spawn(f"{source}-{rep}", largs)
                        res = fleet.wait_file(child, out, timeout_s=600)
                        fleet.wait_exit(child, timeout_s=60)
                    res["cold_start_s"] = res["verified_at"] - child.started
                    results[source].append(res)
            fleet.close()
        base = memcpy_seconds(nbytes)
        transport_gbps: dict[str, float] = {}
        for provider in providers:
            with console.status(f"transport large reads on {provider}"):
                transport_gbps[provider] = large_read_gbps(provider)
    finally:
        fleet.close()
        shutil.rmtree(workdir, ignore_errors=True)

    rows = []
    for source, runs in results.items():
        cold = statistics.median(r["cold_start_s"] for r in runs)
        load = statistics.median(r["seconds"] for r in runs)
        gbps = nbytes / load / 1e9
        wire = transport_gbps.get(source.removeprefix("rfork-")) if source.startswith("rfork-") else None
        rows.append(
            {
                "source": source,
                "cold_start_s": round(cold, 3),
                "load_s": round(load, 3),
                "gb_per_s": round(gbps, 3),
                "ratio_to_memcpy": round(load / base, 1),
                "transport_gb_per_s": round(wire, 3) if wire else None,
                "pull_efficiency": round(gbps / wire, 3) if wire else None,
                "phases": _median_phases(runs),
                "verified": all(r["verified"] for r in runs),
                "actual_sources": sorted({r["source"] for r in runs}),
                "runs": [round(r["cold_start_s"], 3) for r in runs],
            }
        )
    table = Table(
        title=f"cold start, {nbytes / 1e9:.2f} GB, median of {args.repeat}; page cache: {cache_state}"
    )
    columns = (
        "source",
        "process start → verified (s)",
        "load (s)",
        "GB/s",
        "× memcpy",
        "transport GB/s",
        "pull efficiency",
        "verified",
    )
    for col in columns:
        table.add_column(col, justify="left" if col == "source" else "right")
    for r in rows:
        table.add_row(
            r["source"],
            f"{r['cold_start_s']:.2f}",
            f"{r['load_s']:.2f}",
            f"{r['gb_per_s']:.2f}",
            f"{r['ratio_to_memcpy']:.1f}",
            "-" if r["transport_gb_per_s"] is None else f"{r['transport_gb_per_s']:.2f}",
            "-" if r["pull_efficiency"] is None else f"{r['pull_efficiency']:.2f}",
            "yes" if r["verified"] else ("n/a (disk)" if r["source"] == "disk" else "NO"),
        )
    console.print(table)
    console.print(
        f"baseline: one memcpy of {nbytes / 1e9:.2f} GB = {base:.3f} s ({nbytes / base / 1e9:.1f} GB/s); "
        f"× memcpy = load seconds / memcpy seconds; transport GB/s = the engine's own 8 MiB reads, "
        f"8 in flight, into pre-faulted memory, same run; pull efficiency = GB/s / transport GB/s"
    )
    doc = {
        "model_bytes": nbytes,
        "memcpy_s": round(base, 4),
        "transport_gb_per_s": {p: round(v, 3) for p, v in transport_gbps.items()},
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "page_cache": cache_state,
        "repeat": args.repeat,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1, allow_nan=False))
    return 0
