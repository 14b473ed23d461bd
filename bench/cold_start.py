"""Cold start per source: time from process start to weights verified, against same-run baselines.

Two destinations (`--dest`):
- allocated: `rfork load`, the loader allocating its buffers per the seed's manifest. They are fresh
  memory: every page is first touched during the load.
- initialized: a framework's startup (`bench.framework_child`): the model's tensors built and
  initialised first, then filled in place by `pull_into` (or `read_rank_into` for disk).

Sources: disk (rfork's disk loader), runai (Run:ai Model Streamer, PyPI `runai-model-streamer`, into
the framework's tensors: `--dest initialized` only), rfork-tcp, rfork-shm, nccl. `--drop-caches`
drops the page cache before every disk and runai run.

Baselines measured in the same run, for the same bytes:
- memcpy in the destination's memory state: into never-touched memory of a fresh process for
  `allocated` (the cost of first touch, which no loader avoids), between touched buffers for
  `initialized`. For `allocated`, every fresh-memory process (that memcpy and each load) starts after
  `--settle-s` of idle, so that none of them reuses memory the previous one just freed
  (`bench.processes.settle_memory`: on a VM that costs 10x less than memory the host took back);
- per one-sided provider, the transport's own large-read GB/s
  (`bench.transport.large_read_gbps`): the loader's read size and depth, a working set the
  size of the model, into pre-faulted memory with the destination's page size (huge pages as in
  rfork's own buffers for `allocated`, 4 KiB as in torch's for `initialized`), median of 3 passes.
  Pull efficiency = load GB/s / that transport GB/s.
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

ALL_SOURCES = ("disk", "runai", "rfork-tcp", "rfork-shm", "nccl")


OWN_PROGRESS = True  # shows each step with rich status lines: rfork adds no bar of its own

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
    parser.add_argument(
        "--dest",
        choices=("allocated", "initialized"),
        default="allocated",
        help="allocated: the loader allocates fresh buffers (rfork load); initialized: a framework's "
        "own initialised tensors, filled in place by pull_into (default allocated)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per source; the median is reported")
    parser.add_argument(
        "--drop-caches",
        action="store_true",
        help="drop the page cache before each disk run (needs root; else the cache stays warm)",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=None,
        help="with --dest allocated, idle this long before each fresh-memory process so that every row "
        "starts from the same memory state (a VM hands freed memory back to its host; default 3)",
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


def _fresh_memcpy_child(nbytes: int, conn: Any) -> None:
    import torch

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from rfork.weights.memory import empty_host_buffer

    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst = empty_host_buffer(nbytes)  # as the loader allocates; never touched: it faults in during the copy
    t0 = time.perf_counter()
    dst.copy_(src)
    conn.send(time.perf_counter() - t0)


def fresh_memcpy_seconds(nbytes: int) -> float:
    """One memcpy of `nbytes` into never-touched memory, in a fresh process (as a loader's first touch
    of its destination: page faults and zeroing, and on a VM the host backing the pages)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_fresh_memcpy_child, args=(nbytes, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(120 + nbytes / 1e8):
            raise RuntimeError("the fresh-memory memcpy baseline did not finish")
        return float(parent.recv())
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


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
    if args.size_gib <= 0 or args.repeat < 1 or (args.settle_s is not None and args.settle_s < 0):
        raise ValueError("--size-gib must be positive, --repeat >= 1 and --settle-s not negative")
    from rich.console import Console
    from rich.table import Table

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from bench.processes import (
        SETTLE_S,
        Fleet,
        available_providers,
        load_args,
        seed_args,
        settle_memory,
    )
    from bench.transport import large_read_gbps
    from planner.server import PlannerServer
    from rfork.weights.synthetic import write_synthetic_checkpoint

    console = Console()
    settle_s = 0.0 if args.dest == "initialized" else SETTLE_S if args.settle_s is None else args.settle_s
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
            fresh_runs: list[float] = []
            for rep in range(args.repeat):
                if args.dest == "allocated":
                    with console.status(f"memcpy into fresh memory, run {rep + 1}/{args.repeat}"):
                        settle_memory(settle_s)
                        fresh_runs.append(fresh_memcpy_seconds(nbytes))
                for source in sources:
                    out = workdir / f"{source}-{rep}.json"
                    if source in ("disk", "runai") and args.drop_caches:
                        cache_state = (
                            "dropped before each disk and runai run"
                            if _drop_caches()
                            else "warm (drop_caches needs root)"
                        )
                    prov = "nccl" if source == "nccl" else source.removeprefix("rfork-")
                    module: str | None = None
                    if source == "runai" and args.dest != "initialized":
                        raise ValueError(
                            "the runai row reads into a framework's tensors: use --dest initialized"
                        )
                    if args.dest == "initialized":
                        module = "bench.framework_child"
                        largs = ["--checkpoint", str(ckpt), "--source", prov, "--json", str(out)]
                        if source not in ("disk", "runai"):
                            largs += ["--planner", planner.url]
                    elif source == "disk":
                        largs = load_args(out, planner_url=None, checkpoint=ckpt)
                    else:
                        largs = load_args(out, planner_url=planner.url, checkpoint_id=model, providers=[prov])
                    with console.status(f"{source} run {rep + 1}/{args.repeat}"):
                        settle_memory(settle_s)
                        child = fleet.spawn(f"{source}-{rep}", largs, module=module)
                        res = fleet.wait_file(child, out, timeout_s=600)
                        fleet.wait_exit(child, timeout_s=60)
                    res["cold_start_s"] = res["verified_at"] - child.started
                    results[source].append(res)
            fleet.close()
        warm_memcpy = memcpy_seconds(nbytes)
        base = statistics.median(fresh_runs) if fresh_runs else warm_memcpy
        transport_gbps: dict[str, float] = {}
        working_set = max(8 << 20, nbytes // (8 << 20) * (8 << 20))
        for provider in providers:
            with console.status(f"transport large reads on {provider}"):
                transport_gbps[provider] = large_read_gbps(
                    provider,
                    total=working_set,
                    working_set=working_set,
                    local_huge_pages=args.dest == "allocated",
                    passes=3,
                )
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
        title=f"cold start, {nbytes / 1e9:.2f} GB into {args.dest} memory, median of {args.repeat}; "
        f"page cache: {cache_state}"
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
            "yes" if r["verified"] else ("n/a (disk)" if r["source"] in ("disk", "runai") else "NO"),
        )
    console.print(table)
    state = "never-touched memory, fresh process" if args.dest == "allocated" else "touched memory"
    console.print(
        f"baseline: one memcpy of {nbytes / 1e9:.2f} GB into {state} = {base:.3f} s "
        f"({nbytes / base / 1e9:.1f} GB/s; between touched buffers {warm_memcpy:.3f} s); "
        f"× memcpy = load seconds / that memcpy; transport GB/s = the engine's own 8 MiB reads, "
        f"8 in flight, {working_set / 2**30:.2f} GiB working set, into pre-faulted memory, same run; "
        f"pull efficiency = GB/s / transport GB/s"
        + (f"; {settle_s:g} s idle before each fresh-memory process" if settle_s else "")
    )
    doc = {
        "model_bytes": nbytes,
        "dest": args.dest,
        "memcpy_s": round(base, 4),
        "memcpy_memory": state,
        "memcpy_touched_s": round(warm_memcpy, 4),
        "fresh_memcpy_runs_s": [round(x, 4) for x in fresh_runs],
        "transport_working_set_bytes": working_set,
        "transport_gb_per_s": {p: round(v, 3) for p, v in transport_gbps.items()},
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "page_cache": cache_state,
        "settle_s": settle_s,
        "repeat": args.repeat,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1, allow_nan=False))
    return 0
