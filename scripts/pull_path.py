"""Which of the project's files one pull runs through, and how many lines they hold.

Starts a planner (`rfork planner serve`) and a seed (`rfork seed --checkpoint`) as child processes,
then in this process
calls `Loader.pull_into` on a model's own tensors over tcp and lets it publish itself as a seed.
Every Python function call in this process (all threads) from the pull's start until the seed is
published is recorded; the files of the project (rfork/, planner/, backends/) that those calls ran
in are listed with their line counts. Import-time code does not count: everything is imported
before the trace starts. The planner and the seed run in other processes, so their code does not
count either: this is what a reader follows from `pull_into` to the published seed.

    .venv/bin/python scripts/pull_path.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rfork", "planner", "backends")


def _project_file(path: str) -> str | None:
    try:
        rel = Path(path).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(rel) if rel.parts and rel.parts[0] in PACKAGES else None


def _start_planner(fleet: Any, work: Path) -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    db = f"sqlite:///{work / 'planner.db'}"
    fleet.spawn("planner", ["planner", "serve", "--insecure", "--db", db, "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1):
                return url
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the planner did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="write the file list as JSON here")
    parser.add_argument(
        "--no-seed", action="store_true", help="stop at the verified pull (do not become a seed afterwards)"
    )
    args = parser.parse_args()
    os.environ.setdefault("RFORK_TCP_HOST", "127.0.0.1")
    sys.path.insert(0, str(ROOT))  # bench/ (the process harness) is not installed: it is the checkout's

    import torch

    import rfork
    from bench.processes import Fleet, seed_args
    from rfork.weights.synthetic import LlamaConfig, write_synthetic_checkpoint

    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
    )
    seen: dict[str, int] = {}

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event == "call":
            name = _project_file(frame.f_code.co_filename)
            if name is not None:
                seen[name] = seen.get(name, 0) + 1

    with tempfile.TemporaryDirectory(prefix="rfork-pull-path-") as tmp:
        work = Path(tmp)
        ckpt = write_synthetic_checkpoint(work / "ckpt", config=cfg)
        info = rfork.read_checkpoint_info(ckpt)
        fleet = Fleet(work / "procs")
        try:
            planner_url = _start_planner(fleet, work)
            seed = fleet.spawn("seed", seed_args(ckpt, planner_url, work / "ready.json"))
            fleet.wait_file(seed, work / "ready.json", timeout_s=120)
            tensors = {n: torch.empty(tuple(s), dtype=getattr(torch, d)) for n, d, s in cfg.tensor_specs()}
            loader = rfork.Loader(
                identity=info.identity(),
                planner_url=planner_url,
                checkpoint=info,
                options=rfork.LoadOptions(providers=("tcp",), become_seed=not args.no_seed),
            )
            threading.setprofile(profile)
            sys.setprofile(profile)
            try:
                result = loader.pull_into(tensors)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)
            try:
                if (
                    result.source != "rfork-tcp"
                    or not result.verified
                    or (result.seed is None) != args.no_seed
                ):
                    print(f"the pull did not go as planned: {result.source}, verified={result.verified}")
                    return 1
            finally:
                result.close()
        finally:
            fleet.close()

    rows = sorted((name, sum(1 for _ in (ROOT / name).open())) for name in seen)
    width = max(len(n) for n, _ in rows)
    for name, lines in rows:
        print(f"{name:<{width}}  {lines:5d} lines  {seen[name]:7d} calls")
    total = sum(lines for _, lines in rows)
    until = "the weights are verified" if args.no_seed else "the seed is published"
    print(f"{len(rows)} files, {total} lines (one tcp pull_into, from the call until {until})")
    if args.json:
        args.json.write_text(json.dumps({"files": dict(rows), "calls": seen, "total_lines": total}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
