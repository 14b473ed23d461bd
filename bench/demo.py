"""Cold-start demo: what an engine's start-up costs by each source, on one host, then on a fleet.

One host: a seed, then instances that build a model's tensors and fill them in place, as the
SGLang/vLLM hooks do (`bench.framework_child`): from disk with the page cache dropped and warm, by
Run:ai Model Streamer (the loader a user would pick instead), and by R-Fork over tcp, shm, the
NCCL/gloo fallback, and from an R-Forked instance (chain).

A fleet (where this process can create network namespaces: root on Linux): 8 emulated hosts with
shaped NICs and a storage host on one capped link (bench.fleet), all loaders started at once, by the
R-Fork tree and all from storage; the planner's fleet page is forwarded to 127.0.0.1 while it runs.
"""

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
        "--size-gib", type=float, default=2.0, help="one-host checkpoint size (default 2 GiB)"
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
    parser.add_argument("--no-runai", action="store_true", help="skip the Run:ai Model Streamer row")
    parser.add_argument("--no-fleet", action="store_true", help="skip the fleet part")
    parser.add_argument(
        "--fleet-model-gb", type=float, default=0.5, help="fleet part: model size, GB (default 0.5)"
    )
    parser.add_argument(
        "--fleet-nic-mbit", type=float, default=500.0, help="fleet part: host NICs, Mbit/s (default 500)"
    )
    parser.add_argument(
        "--ui-port",
        type=int,
        default=8471,
        help="fleet part: the fleet page on 127.0.0.1:PORT (default 8471)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs) for inspection")


def run(args: argparse.Namespace) -> int:
    """Run the whole demo; every process and file is cleaned up on exit, error or Ctrl-C."""
    if args.size_gib <= 0 or args.fleet_model_gb <= 0:
        raise ValueError("--size-gib and --fleet-model-gb must be positive")
    from rich.console import Console

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from bench.processes import Fleet, available_providers

    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="rfork-demo-"))
    fleet = Fleet(workdir, verbose=args.verbose > 0)
    doc: dict[str, Any] = {}
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
        providers, skipped = available_providers([p.strip() for p in args.providers.split(",") if p.strip()])
        for s in skipped:
            console.print(f"[yellow]skipping {s}[/yellow]")
        with PlannerServer(db_url=f"sqlite:///{workdir / 'planner.db'}", insecure=True) as planner:
            console.print(f"planner: {planner.url} (SQLite {workdir / 'planner.db'}, insecure)")
            rows, model_bytes, cache = _one_host(console, fleet, workdir, ckpt, planner.url, providers, args)
            fleet.close()
        _print_table(console, rows, model_bytes, cache)
        doc = {"model_bytes": model_bytes, "page_cache": cache, "rows": rows}
        if not args.no_fleet:
            doc["fleet"] = _fleet_part(console, args)
        if args.json:
            args.json.write_text(json.dumps(doc, indent=1, allow_nan=False))
        return 0
    finally:
        fleet.close()
        if args.keep:
            console.print(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _one_host(
    console: Any, fleet: Any, workdir: Path, ckpt: Path, planner_url: str, providers: list[str], args: Any
) -> tuple[list[dict[str, Any]], int, str]:
    """The one-host rows: each a fresh engine-like process filling its own initialised tensors."""
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from bench.cold_start import _drop_caches
    from bench.processes import load_args, seed_args

    rows: list[dict[str, Any]] = []
    with console.status("starting the seed (loads from disk, registers, checksums, publishes)"):
        ready = workdir / "seed.json"
        seed = fleet.spawn("seed", seed_args(ckpt, planner_url, ready, providers=providers))
        info = fleet.wait_file(seed, ready, timeout_s=300)
    model_bytes = int(info["bytes"])
    model = info["identity"]["model"]
    seed_ids = list(info["instance_ids"])
    console.print(f"seed READY: {model}, {model_bytes / 1e9:.2f} GB, instance(s) {', '.join(seed_ids)}")
    can_drop = _drop_caches()
    cache = "dropped before the cold rows" if can_drop else "warm only (dropping the page cache needs root)"

    def one(name: str, label: str, source: str, *, drop: bool = False, extra: tuple[str, ...] = ()) -> None:
        out = workdir / f"{name}.json"
        largs = ["--checkpoint", str(ckpt), "--source", source, "--json", str(out), *extra]
        if source not in ("disk", "runai"):
            largs += ["--planner", planner_url]
        with console.status(label):
            if drop:
                _drop_caches()
            child = fleet.spawn(name, largs, module="bench.framework_child")
            res = fleet.wait_file(child, out, timeout_s=300)
            fleet.wait_exit(child, timeout_s=60)
        row = {
            "row": name,
            "source": res["source"],
            "seconds": round(res["seconds"], 3),
            "gb_per_s": round(res["bytes"] / max(res["seconds"], 1e-9) / 1e9, 3),
            "verified": res["verified"],
            "since_process_start_s": round(res["since_start_s"], 3),
            "phases": res.get("phases", {}),
        }
        rows.append(row)
        console.print(f"  {label}: {row['seconds']:.2f} s, {row['gb_per_s']:.2f} GB/s")

    if can_drop:
        one("disk (cold)", "disk, page cache dropped", "disk", drop=True)
        if not args.no_runai and _runai_available():
            one("runai (cold)", "Run:ai Model Streamer, page cache dropped", "runai", drop=True)
    one("disk (warm)", "disk, page cache warm", "disk")
    if not args.no_runai:
        if _runai_available():
            one("runai (warm)", "Run:ai Model Streamer, page cache warm", "runai")
        else:
            console.print("[yellow]skipping Run:ai (pip install runai-model-streamer)[/yellow]")
    for p in providers:
        one(f"rfork-{p}", f"R-Fork over {p}", p)
    if not args.no_nccl:
        one("nccl", "R-Fork's NCCL/gloo fallback (seed streams, two-sided)", "nccl")
    if "tcp" in providers:
        with console.status("an instance R-Forks and serves (the chain's middle)"):
            mid_out = workdir / "middle.json"
            mid = fleet.spawn(
                "middle",
                load_args(
                    mid_out, planner_url=planner_url, checkpoint_id=model, providers=["tcp"], then="serve"
                ),
            )
            fleet.wait_file(mid, mid_out, timeout_s=300)
        one(
            "chain",
            "R-Fork from an R-Forked instance (chain)",
            "tcp",
            extra=tuple(a for s in seed_ids for a in ("--exclude", s)),
        )
    return rows, model_bytes, cache


def _runai_available() -> bool:
    try:
        import runai_model_streamer  # noqa: F401
    except ImportError:
        return False
    return True


def _fleet_part(console: Any, args: Any) -> dict[str, Any]:
    """8 emulated hosts: the R-Fork tree, then all from storage; or one line saying why not."""
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from bench.fleet.network import can_make_namespaces

    why = can_make_namespaces()
    if why is not None:
        console.print(f"[yellow]fleet part skipped: {why}[/yellow]")
        return {"skipped": why}
    from bench.fleet.report import ideal_tree_s, summarise, transfer_s
    from bench.fleet.run import FleetConfig, run_fleet

    cfg = FleetConfig(loaders=8, model_bytes=int(args.fleet_model_gb * 1e9), nic_mbit=args.fleet_nic_mbit,
                      planner_port_ui=args.ui_port, timeout_s=300)  # fmt: skip
    console.print(
        f"fleet: 8 loaders on emulated hosts (network namespaces), {args.fleet_nic_mbit:g} Mbit/s NICs, "
        f"storage on one link of the same rate, {args.fleet_model_gb:g} GB model"
    )
    out: dict[str, Any] = {
        "config": {"loaders": 8, "model_gb": args.fleet_model_gb, "nic_mbit": args.fleet_nic_mbit}
    }
    for mode in ("tree", "storage"):
        with console.status(f"fleet, {mode}: starting") as status:

            def progress(msg: str, m: str = mode, st: Any = status) -> None:
                if "planner host" in msg and m == "tree":
                    console.print(
                        f"  watch the tree grow: http://127.0.0.1:{args.ui_port}/ui (no token needed)"
                    )
                st.update(f"fleet, {m}: {msg}")

            doc = run_fleet(replace_ui(cfg, mode), mode, progress=progress)
        s = summarise(doc)
        out[mode] = {
            "all_ready_s": s["all_ready_s"],
            "verified": s["verified"],
            "from": s["from"],
            "cpu_saturated": s["cpu_saturated"],
        }
        console.print(f"  {mode}: all ready {s['all_ready_s']} s after the start, verified {s['verified']}")
    tree, storage = out["tree"]["all_ready_s"], out["storage"]["all_ready_s"]
    ideal = ideal_tree_s(8, cfg.model_bytes, cfg.nic_mbit)
    if tree and storage:
        out["speedup"] = round(storage / tree, 2)
        out["ideal_speedup"] = round(8 * transfer_s(cfg.model_bytes, cfg.nic_mbit) / ideal, 2)
        console.print(
            f"fleet: the R-Fork tree is {out['speedup']:.2f}x faster than all from storage "
            f"(ideal {out['ideal_speedup']:.2f}x: log2 doubling against one storage link)"
        )
    return out


def replace_ui(cfg: Any, mode: str) -> Any:
    """The fleet config for `mode`: the forwarded fleet page only where there is a planner (the tree)."""
    from dataclasses import replace

    return cfg if mode == "tree" else replace(cfg, planner_port_ui=0)


def _print_table(console: Any, rows: list[dict[str, Any]], model_bytes: int, cache: str) -> None:
    from rich.table import Table

    gb = model_bytes / 1e9
    table = Table(title=f"one host: {gb:.2f} GB into an engine's initialised tensors (page cache: {cache})")
    base = next((r["seconds"] for r in rows if r["row"] == "disk (cold)"), rows[0]["seconds"])
    for col in ("row", "seconds", "GB/s", "speed-up vs first disk row", "verified"):
        table.add_column(col, justify="left" if col == "row" else "right")
    for r in rows:
        table.add_row(
            r["row"],
            f"{r['seconds']:.2f}",
            f"{r['gb_per_s']:.2f}",
            f"{base / max(r['seconds'], 1e-9):.2f}x",
            "yes"
            if r["verified"]
            else "n/a (no digests on disk)"
            if r["source"] in ("disk", "runai")
            else "NO",
        )
    console.print(table)
