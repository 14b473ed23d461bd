"""Rollouts: v2 of a model from what v1 shares with it, locally or from v1's seeds.

Two `rfork seed` processes serve over tcp: v2, a synthetic Llama checkpoint of --size-gib (bf16), and
v1, the same tensors with a --changed fraction of them (a random sample, --seed) holding other values.
Per --repeat, each row starts from the same state in the same touched memory (the destination copied
back to v1, or zeroed for a new instance) and pulls v2 into it, verified (every digest compared with
the anchored ones):
- full: every tensor from the v2 seed (`LoadOptions()`);
- rollout: the destination (holding v1) is digested first and only the tensors whose digest differs are
  read (`LoadOptions(keep_matching=True)`);
- rollout, held digests: the same, given the digests v1's own load recorded (`held_digests`), so
  nothing is hashed;
- new instance, full / rollout: a destination holding nothing; with keep_matching the tensors v1 shares
  come from the v1 seed (the planner finds it through equal anchored digests), the rest from v2's.
After each pull the destination is compared with v2 tensor by tensor. Median seconds per row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork bench rollout`."""
    parser.add_argument("--size-gib", type=float, default=1.0, help="model size (default 1 GiB)")
    parser.add_argument(
        "--changed", type=float, default=0.1, help="fraction of tensors that differ (default 0.1)"
    )
    parser.add_argument("--seed", type=int, default=0, help="picks which tensors differ (default 0)")
    parser.add_argument("--repeat", type=int, default=3, help="pulls per row; the median is reported")
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")


def _pull(
    planner_url: str,
    identity: Any,  # noqa: ANN401
    dest: dict[str, Any],
    keep: bool,
    held: dict[str, str] | None,
) -> dict[str, Any]:
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from rfork import LoadOptions, pull_into

    opts = LoadOptions(providers=["tcp"], become_seed=False, keep_matching=keep)
    result = pull_into(
        identity=identity, planner_url=planner_url, tensors=dest, options=opts, held_digests=held
    )
    try:
        return {
            "seconds": result.seconds,
            "bytes": result.bytes,
            "from_v2": result.attempts[-1].bytes,  # the identity's own seed (other identities' come first)
            "kept_bytes": result.kept_bytes,
            "keep_s": result.phases.get("keep", 0.0),
            "verified": result.verified,
            "source": result.source,
        }
    finally:
        result.close()


def _measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    import torch
    from safetensors.torch import save_file

    from bench.processes import Fleet, seed_args
    from planner.server import PlannerServer
    from rfork.weights.checkpoint import load_state_dict, read_checkpoint_info
    from rfork.weights.rank_weights import RankWeights
    from rfork.weights.synthetic import write_synthetic_checkpoint

    ckpt = write_synthetic_checkpoint(workdir / "v2", size_bytes=int(args.size_gib * (1 << 30)))
    identity = read_checkpoint_info(ckpt).identity(tp=1, revision="v2")
    v2 = load_state_dict(ckpt)
    names = sorted(v2)
    changed = random.Random(args.seed).sample(names, max(1, round(args.changed * len(names))))
    v1 = {n: t.clone() for n, t in v2.items()}
    for n in changed:
        v1[n].add_(1)
    v1_dir = workdir / "v1"
    v1_dir.mkdir()
    save_file(v1, str(v1_dir / "model.safetensors"))
    shutil.copy(ckpt / "config.json", v1_dir / "config.json")
    dest = {n: torch.empty_like(t) for n, t in v2.items()}
    model_bytes = sum(t.nbytes for t in v2.values())
    held = RankWeights.from_tensors(tensors=v1).compute_checksums()  # what v1's own load recorded
    rows = {  # (what the destination holds, keep_matching, held digests)
        "full": ("v1", False, None),
        "rollout": ("v1", True, None),
        "rollout, held digests": ("v1", True, held),
        "new instance, full": ("nothing", False, None),
        "new instance, rollout": ("nothing", True, None),
    }
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
    equal = True
    fleet = Fleet(workdir / "procs")
    try:
        with PlannerServer(db_url=f"sqlite:///{workdir / 'planner.db'}", insecure=True) as planner:
            seeds = []
            for version, directory in (("v2", ckpt), ("v1", v1_dir)):
                ready = workdir / f"{version}.json"
                args_ = seed_args(directory, planner.url, ready, extra=["--revision", version])
                seeds.append((fleet.spawn(f"seed-{version}", args_), ready))
            for child, ready in seeds:
                fleet.wait_file(child, ready, timeout_s=600)
            for _ in range(args.repeat):
                for row, (holds, keep, digests) in rows.items():
                    for n, t in dest.items():
                        if holds == "v1":
                            t.copy_(v1[n])
                        else:
                            t.zero_()
                    runs[row].append(_pull(planner.url, identity, dest, keep, digests))
                    equal = equal and all(torch.equal(dest[n], v2[n]) for n in names)
    finally:
        fleet.close()
    table = []
    for row, got in runs.items():
        table.append(
            {
                "row": row,
                "holds": rows[row][0],
                "bytes": got[0]["bytes"],
                "from_v2": got[0]["from_v2"],
                "seconds": statistics.median(r["seconds"] for r in got),
                "keep_s": statistics.median(r["keep_s"] for r in got),
                "verified": all(r["verified"] and r["source"] == "rfork-tcp" for r in got),
            }
        )
    return {
        "model_bytes": model_bytes,
        "tensors": len(names),
        "tensors_changed": len(changed),
        "bytes_changed": sum(v2[n].nbytes for n in changed),
        "equal": equal,
        "rows": table,
    }


def run(args: argparse.Namespace) -> int:
    """Measure, print the table, optionally write JSON."""
    if args.size_gib <= 0 or args.repeat < 1 or not 0 < args.changed <= 1:
        raise ValueError("--size-gib positive; --repeat at least 1; --changed in (0, 1]")
    from rich.console import Console
    from rich.table import Table

    os.environ.setdefault("RFORK_TCP_HOST", "127.0.0.1")
    console = Console()
    with tempfile.TemporaryDirectory(prefix="rfork-rollout-") as tmp, console.status("measuring"):
        got = _measure(args, Path(tmp))
    load = os.getloadavg()
    full = next(r for r in got["rows"] if r["row"] == "full")
    table = Table(
        title=f"Rollout v1 -> v2: {got['model_bytes'] / 1e9:.2f} GB bf16, {got['tensors_changed']} of "
        f"{got['tensors']} tensors changed ({100 * got['bytes_changed'] / got['model_bytes']:.1f} % of the "
        f"bytes), tcp loopback, median of {args.repeat}; load average {load[0]:.1f}"
    )
    cols = ("pull", "holds", "read", "from the v2 seed", "of the model", "seconds", "hashing", "× full")
    for col in cols:
        table.add_column(col, justify="right")
    for r in got["rows"]:
        table.add_row(
            r["row"],
            r["holds"],
            f"{r['bytes'] / 1e6:.1f} MB",
            f"{r['from_v2'] / 1e6:.1f} MB",
            f"{100 * r['from_v2'] / got['model_bytes']:.1f} %",
            f"{r['seconds']:.3f}",
            f"{r['keep_s']:.3f}",
            f"{full['seconds'] / r['seconds']:.2f}",
        )
    console.print(table)
    ok = got["equal"] and all(r["verified"] for r in got["rows"])
    console.print(f"verified (digests compared) and equal to v2: {'yes' if ok else 'NO'}")
    if args.json:
        doc = {
            "size_gib": args.size_gib,
            "changed": args.changed,
            "repeat": args.repeat,
            "load_average": [round(x, 2) for x in load],
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        } | got
        args.json.write_text(json.dumps(doc, indent=1))
    return 0 if ok else 1
