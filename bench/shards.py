"""A TP rank's slice from a seed of whole tensors, against pulling the whole checkpoint, in one run.

One planner and one `rfork seed --checkpoint` process (TP=1: whole tensors, with stripe digests) over
tcp on loopback; in this process, per repeat and rank of `--tp`, a loader of the TP=`--tp` checkpoint
identity pulls its slice (`shard`) and a loader of the TP=1 identity pulls everything (`whole`: what a
rank of checkpoint mode moves today), each into fresh buffers, in alternating order, after one round
of each that is not counted (the first touches of this process's memory). It also times the
digests a seed computes (each tensor's, and the stripes of the split ones) over the same weights, and
sizes the manifest with and without stripes.

    rfork bench shards --size-mib 256 --tp 2 [--repeat 3] [--json FILE]

Run it alone on a quiet machine (`flock /tmp/rfork-bench.lock`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20


def configure(parser: argparse.ArgumentParser) -> None:
    """Options: checkpoint size, TP size, repeats, JSON output."""
    parser.add_argument("--size-mib", type=int, default=256, help="synthetic checkpoint size (default 256)")
    parser.add_argument("--tp", type=int, choices=(2, 4, 8), default=2, help="the loaders' TP (default 2)")
    parser.add_argument("--repeat", type=int, default=3, help="pulls per mode and rank; medians are shown")
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")


def run(args: argparse.Namespace) -> int:
    """Measure, print the tables, write JSON."""
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from bench.processes import Fleet, seed_args
    from planner.server import PlannerServer
    from rfork import Loader, LoadOptions
    from rfork.weights.checkpoint import read_checkpoint_info
    from rfork.weights.synthetic import config_for_size, write_synthetic_checkpoint

    os.environ.setdefault("RFORK_TCP_HOST", "127.0.0.1")
    workdir = Path(tempfile.mkdtemp(prefix="rfork-bench-shards-"))
    ckpt = write_synthetic_checkpoint(workdir / "ckpt", config=config_for_size(args.size_mib * MiB))
    info = read_checkpoint_info(ckpt)
    digests = _digest_costs(ckpt)
    options = LoadOptions(providers=["tcp"], become_seed=False)
    rows: list[dict[str, Any]] = []
    fleet = Fleet(workdir / "procs")
    try:
        with PlannerServer(db_url=f"sqlite:///{workdir / 'planner.db'}", insecure=True) as planner:
            ready = workdir / "seed.json"
            seed = fleet.spawn("seed", seed_args(ckpt, planner.url, ready))
            fleet.wait_file(seed, ready, timeout_s=600)
            whole, shard = info.identity(), info.identity(tp=args.tp)
            for rank in range(args.tp):
                runs: dict[str, list[tuple[float, int]]] = {"shard": [], "whole": []}
                for rep in range(-1, args.repeat):  # round -1 warms the memory both modes reuse: not counted
                    order = ("shard", "whole") if rep % 2 == 0 else ("whole", "shard")
                    for mode in order:
                        ident, asked = (shard, rank) if mode == "shard" else (whole, 0)
                        t0 = time.perf_counter()
                        loader = Loader(identity=ident, planner_url=planner.url, options=options)
                        result = loader.load([asked])
                        seconds = time.perf_counter() - t0
                        if not result.verified or not result.source.startswith("rfork-"):
                            raise RuntimeError(f"{mode} rank {rank}: from {result.source}, not from the seed")
                        if rep >= 0:
                            runs[mode].append((seconds, result.bytes))
                        result.close()
                shard_bytes = runs["shard"][0][1]
                for mode, figures in runs.items():
                    rows.append(
                        {
                            "rank": rank,
                            "mode": mode,
                            "bytes": figures[0][1],
                            "bytes_vs_shard": figures[0][1] / shard_bytes,
                            "seconds": statistics.median(s for s, _ in figures),
                        }
                    )
    finally:
        fleet.close()
    _print(args, info.total_bytes, rows, digests)
    if args.json:
        doc = {
            "size_bytes": info.total_bytes,
            "tp": args.tp,
            "repeat": args.repeat,
            "load_avg": os.getloadavg()[0],
            "pulls": rows,
            "digests": digests,
        }
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


def _digest_costs(ckpt: Path) -> list[dict[str, Any]]:
    """Per host algorithm: seconds for every tensor's digest and for the stripes, best of 3, and the
    manifest's JSON size without and with stripes."""
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from rfork.weights.checkpoint import load_rank_from_disk, read_checkpoint_info
    from rfork.weights.rank_weights import RankWeights

    layout, buffers, tensors = load_rank_from_disk(read_checkpoint_info(ckpt))
    weights = RankWeights(rank=0, layout=layout, buffers=buffers, tensors=tensors)
    out = []
    before = os.environ.get("RFORK_DIGEST")
    try:
        for algorithm in ("xxh3-128", "blake3"):
            os.environ["RFORK_DIGEST"] = algorithm
            whole, striped = [], []
            for _ in range(3):
                weights.checksums.clear()
                weights.stripes.clear()
                t0 = time.perf_counter()
                weights.compute_checksums()
                t1 = time.perf_counter()
                weights.compute_stripes()
                whole.append(t1 - t0)
                striped.append(time.perf_counter() - t1)
            descriptors = [b"x" * 64] * len(layout.region_sizes)
            plain = len(weights.manifest(descriptors).model_dump_json())
            weights.striped = True
            with_stripes = len(weights.manifest(descriptors).model_dump_json())
            weights.striped = False
            out.append(
                {
                    "algorithm": algorithm,
                    "tensor_digests_s": min(whole),
                    "stripe_digests_s": min(striped),
                    "manifest_bytes": plain,
                    "manifest_bytes_with_stripes": with_stripes,
                }
            )
    finally:
        if before is None:
            os.environ.pop("RFORK_DIGEST", None)
        else:
            os.environ["RFORK_DIGEST"] = before
    return out


def _print(
    args: argparse.Namespace, total: int, rows: list[dict[str, Any]], digests: list[dict[str, Any]]
) -> None:
    from rich.console import Console  # imported here: see run()
    from rich.table import Table

    console = Console()
    pulls = Table(title=f"TP={args.tp} ranks of a {total / MiB:.0f} MiB checkpoint from one TP=1 seed (tcp)")
    for col in ("rank", "mode", "MiB moved", "vs its shard", "seconds (median)"):
        pulls.add_column(col, justify="right")
    for r in rows:
        pulls.add_row(
            str(r["rank"]),
            r["mode"],
            f"{r['bytes'] / MiB:.1f}",
            f"{r['bytes_vs_shard']:.2f}x",
            f"{r['seconds']:.3f}",
        )
    console.print(pulls)
    cost = Table(title="What a TP=1 seed digests: every tensor, then the stripes of the split ones")
    columns = ("algorithm", "tensors s", "stripes s", "stripes/tensors", "manifest KiB", "with stripes")
    for col in columns:
        cost.add_column(col, justify="right")
    for d in digests:
        cost.add_row(
            d["algorithm"],
            f"{d['tensor_digests_s']:.3f}",
            f"{d['stripe_digests_s']:.3f}",
            f"{d['stripe_digests_s'] / d['tensor_digests_s']:.2f}x",
            f"{d['manifest_bytes'] / 1024:.1f}",
            f"{d['manifest_bytes_with_stripes'] / 1024:.1f}",
        )
    console.print(cost)
    console.print(f"load average {os.getloadavg()[0]:.2f}")
