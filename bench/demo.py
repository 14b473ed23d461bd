"""Cold-start demo: one seed, then instances loaded from disk and by R-Fork (tcp, shm, and a chain)."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("rfork.demo")


OWN_PROGRESS = True  # shows each step with rich status lines: rfork adds no bar of its own


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork demo`."""
    parser.add_argument(
        "--size-gib", type=float, default=2.0, help="synthetic checkpoint size (default 2 GiB)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument(
        "--provider",
        "--providers",
        dest="providers",
        default="tcp,shm",
        help="one-sided providers to show (default tcp,shm)",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="use this checkpoint instead of generating one (kept afterwards)",
    )
    parser.add_argument("--no-nccl", action="store_true", help="skip the NCCL/gloo fallback row")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs) for inspection")
    parser.add_argument(
        "--settle-s",
        type=float,
        default=None,
        help="idle this long before each instance, so that every row starts from the same memory state "
        "(a VM hands freed memory back to its host; default 3)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the whole demo; every process and file is cleaned up on exit, error or Ctrl-C."""
    if args.size_gib <= 0 or (args.settle_s is not None and args.settle_s < 0):
        raise ValueError("--size-gib must be positive and --settle-s not negative")
    from rich.console import Console

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from bench.processes import SETTLE_S, Fleet, available_providers

    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="rfork-demo-"))
    fleet = Fleet(workdir, verbose=args.verbose > 0)
    try:
        from planner import PlannerServer

        if args.checkpoint is None:
            from rfork.weights.synthetic import write_synthetic_checkpoint

            size = int(args.size_gib * (1 << 30))
            with console.status(f"writing a {args.size_gib:g} GiB synthetic Llama checkpoint"):
                t0 = time.perf_counter()
                ckpt = write_synthetic_checkpoint(workdir / "checkpoint", size_bytes=size)
            console.print(f"checkpoint: {ckpt} ({time.perf_counter() - t0:.1f} s to generate)")
        else:
            ckpt = args.checkpoint
        with_nccl = not args.no_nccl
        settle_s = SETTLE_S if args.settle_s is None else args.settle_s
        providers, skipped = available_providers([p.strip() for p in args.providers.split(",") if p.strip()])
        for s in skipped:
            console.print(f"[yellow]skipping {s}[/yellow]")
        with PlannerServer(db_url=f"sqlite:///{workdir / 'planner.db'}", insecure=True) as planner:
            console.print(f"planner: {planner.url} (SQLite {workdir / 'planner.db'}, insecure)")
            rows, model_bytes = _scenario(
                console, fleet, workdir, ckpt, planner.url, providers, with_nccl, settle_s
            )
            fleet.close()
        _print_table(console, rows, model_bytes)
        if args.json:
            doc = {"model_bytes": model_bytes, "settle_s": settle_s, "rows": rows}
            args.json.write_text(json.dumps(doc, indent=1, allow_nan=False))
        return 0
    finally:
        fleet.close()
        if args.keep:
            console.print(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _scenario(
    console: Any,
    fleet: Any,
    workdir: Path,
    ckpt: Path,
    planner_url: str,
    providers: list[str],
    with_nccl: bool,
    settle_s: float,
) -> tuple[list[dict[str, Any]], int]:
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from bench.processes import load_args, seed_args, settle_memory

    rows: list[dict[str, Any]] = []
    with console.status("starting the seed (loads from disk, registers, checksums, publishes)"):
        ready = workdir / "seed.json"
        seed = fleet.spawn("seed", seed_args(ckpt, planner_url, ready, providers=providers))
        info = fleet.wait_file(seed, ready, timeout_s=300)
    model_bytes = int(info["bytes"])
    model = info["identity"]["model"]
    seed_ids = list(info["instance_ids"])
    console.print(f"seed READY: {model}, {model_bytes / 1e9:.2f} GB, instance(s) {', '.join(seed_ids)}")

    def one(name: str, label: str, args: list[str], *, keep: bool = False, **extra: Any) -> dict[str, Any]:
        out = workdir / f"{name}.json"
        with console.status(f"{label}"):
            settle_memory(settle_s)  # each instance loads into fresh memory: the same state for every row
            child = fleet.spawn(name, args)
            res = fleet.wait_file(child, out, timeout_s=300)
            if not keep:
                fleet.wait_exit(child, timeout_s=60)
        row = {
            "source": res["source"],
            "seconds": round(res["seconds"], 3),
            "gb_per_s": round(res["bytes"] / max(res["seconds"], 1e-9) / 1e9, 3),
            "verified": res["verified"],
            "bytes": res["bytes"],
            "since_process_start_s": round(res["since_start_s"], 3),
            "phases": res.get("phases", {}),
            **extra,
        }
        rows.append(row)
        console.print(
            f"  {label}: {row['seconds']:.2f} s, {row['gb_per_s']:.2f} GB/s, source {row['source']}"
        )
        return res

    one(
        "disk",
        "instance 1 loads from disk (page cache warm)",
        load_args(workdir / "disk.json", planner_url=None, checkpoint=ckpt),
    )
    first: dict[str, Any] | None = None
    for p in providers:
        keep = first is None and p == "tcp"
        res = one(
            f"rfork-{p}",
            f"instance loads by R-Fork over {p}",
            load_args(
                workdir / f"rfork-{p}.json",
                planner_url=planner_url,
                checkpoint_id=model,
                providers=[p],
                then="serve" if keep else "exit",
            ),
            keep=keep,
        )
        if keep:
            first = res
    if with_nccl:
        one(
            "nccl",
            "instance loads over the NCCL/gloo fallback (seed streams, two-sided)",
            load_args(
                workdir / "nccl.json", planner_url=planner_url, checkpoint_id=model, providers=["nccl"]
            ),
        )
    if first is not None and "tcp" in providers:
        one(
            "chain",
            "instance R-Forks from the R-Forked instance (chain)",
            load_args(
                workdir / "chain.json",
                planner_url=planner_url,
                checkpoint_id=model,
                providers=["tcp"],
                exclude=seed_ids,
            ),
            chain=True,
            via=",".join(first["instance_ids"]),
        )
    disk = rows[0]["seconds"]
    for r in rows:
        r["speedup_vs_disk"] = round(disk / max(r["seconds"], 1e-9), 2)
    return rows, model_bytes


def _print_table(console: Any, rows: list[dict[str, Any]], model_bytes: int) -> None:
    from rich.table import Table

    table = Table(title=f"cold start of a {model_bytes / 1e9:.2f} GB model (weights to verified)")
    for col in ("source", "seconds", "GB/s", "speed-up vs disk", "verified"):
        table.add_column(col, justify="left" if col == "source" else "right")
    for r in rows:
        name = r["source"] + (" (chain: from a loaded instance)" if r.get("chain") else "")
        table.add_row(
            name,
            f"{r['seconds']:.2f}",
            f"{r['gb_per_s']:.2f}",
            f"{r['speedup_vs_disk']:.2f}x",
            "yes" if r["verified"] else ("n/a (disk)" if r["source"] == "disk" else "NO"),
        )
    console.print(table)
