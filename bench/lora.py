"""LoRA adapters into a running vLLM server on CPU: from a peer (rfork) against vLLM's filesystem resolver.

A vLLM server (`--enable-lora`, runtime loading on) serves a synthetic Llama of --size-mib with both
resolvers: vLLM's filesystem resolver over a storage directory (VLLM_LORA_RESOLVER_CACHE_DIR) and rfork's
(the planner; no storage of its own). The peer is an rfork seed of each adapter in this process (what a
server that resolved the adapter serves; tests/vllm/test_lora.py runs that server to server). Every
adapter is the same synthetic LoRA (rank --rank on every projection of every layer), copied under one
name per row and run, so each request below is the first to name its adapter; rows are interleaved.
Per row, the seconds of a one-token greedy completion naming the adapter (what a user waits for:
resolve, load, first token):
- base: the base model, no adapter (the floor);
- filesystem, page cache dropped: vLLM's resolver reads the files after `drop_caches` (root only);
- filesystem, page cache warm: the files read just before;
- rfork from a peer: rfork's resolver pulls it from the seed (verified) and writes it to /dev/shm.
The tokens of a longer completion are compared between the filesystem and the peer adapters. Runs where
vLLM is installed (.venv-vllm).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.processes import Child, Fleet, free_port, wait_healthy

PROMPT = [1, 17, 42, 99, 7, 3]


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork bench lora`."""
    parser.add_argument("--size-mib", type=float, default=256.0, help="Llama size (default 256 MiB)")
    parser.add_argument("--rank", type=int, default=64, help="LoRA rank (default 64)")
    parser.add_argument("--repeat", type=int, default=3, help="adapters per row; the median is reported")
    parser.add_argument("--workdir", type=Path, default=None, help="keep model, adapters and logs here")
    parser.add_argument("--timeout", type=float, default=900.0, help="per server start, seconds")
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    """Measure, print the table, optionally write JSON."""
    if args.size_mib <= 0 or args.repeat < 1 or args.rank < 1:
        raise ValueError("--size-mib positive; --repeat and --rank at least 1")
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from planner import PlannerServer
    from rfork.weights import synthetic

    work = args.workdir or Path(tempfile.mkdtemp(prefix="rfork-bench-lora-"))
    work.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(work / "logs")
    can_drop = os.geteuid() == 0
    try:
        config = synthetic.config_for_size(int(args.size_mib * (1 << 20)))
        model = synthetic.write_servable_llama(work / "model", config=config, name="lora-llama")
        storage = work / "adapters"
        first = synthetic.write_synthetic_lora(
            storage / "first", config=config, base_model=str(model), seed=1, rank=args.rank,
            targets=synthetic.LORA_TARGETS,
        )  # fmt: skip
        adapter_bytes = sum(f.stat().st_size for f in first.iterdir())
        rows = ["filesystem, page cache warm", "rfork from a peer"]
        if can_drop:
            rows.insert(0, "filesystem, page cache dropped")
        names = {row: [f"{_slug(row)}-{i}" for i in range(args.repeat)] for row in rows}
        for row_names in names.values():
            for name in row_names:
                if not (storage / name).exists():
                    shutil.copytree(first, storage / name)
        with (
            PlannerServer(db_url=f"sqlite:///{work / 'planner.db'}", insecure=True) as planner,
            contextlib.ExitStack() as seeds,
        ):
            env = {
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
                "RFORK_PLANNER_URL": planner.url,
                "VLLM_LORA_RESOLVER_CACHE_DIR": str(storage),
            }
            server = _start(fleet, "vllm", model, args.rank, env)
            for name in names["rfork from a peer"]:  # the peer: a seed of each adapter, in this process
                seeds.enter_context(_adapter_seed(storage / name, str(model), planner.url))
            wait_healthy(server.child, server.port, args.timeout)
            for _ in range(3):  # the first requests after start are slower (allocation, caches)
                _complete(server, "m")
            load_before = os.getloadavg()
            seconds: dict[str, list[float]] = {row: [] for row in ["base", *rows]}
            for i in range(args.repeat):  # rows interleaved: a drift in the machine's load hits them all
                seconds["base"].append(_timed(server, "m"))
                for row in rows:
                    name = names[row][i]
                    if row.endswith("dropped"):
                        _drop_caches()
                    elif row.endswith("warm"):
                        _read_all(storage / name)
                    seconds[row].append(_timed(server, name))
            equal = _complete(server, names["rfork from a peer"][0], 8) == _complete(
                server, names["filesystem, page cache warm"][0], 8
            )
            load_after = os.getloadavg()
        log = server.child.log_path.read_text(errors="replace")
    finally:
        fleet.close()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    results = {
        "size_mib": args.size_mib,
        "rank": args.rank,
        "adapter_bytes": adapter_bytes,
        "repeat": args.repeat,
        "load_average": [round(load_before[0], 2), round(load_after[0], 2)],
        "first_request_s": {row: statistics.median(s) for row, s in seconds.items()},
        "runs": seconds,
        "tokens_equal": equal,
        # whether rfork's resolver was asked first for the filesystem rows (a planner miss inside them)
        "filesystem_rows_asked_rfork_first": any(
            f"LoRA adapter {n}: no seed" in log for row in rows[:-1] for n in names[row]
        ),
        "page_cache_dropped": can_drop,
    }
    _print(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if equal else 1


class _Server:
    def __init__(self, child: Child, port: int) -> None:
        self.child = child
        self.port = port


@contextlib.contextmanager
def _adapter_seed(directory: Path, base: str, planner_url: str) -> Iterator[None]:
    """Serve the adapter in `directory` as an rfork seed (what a server that resolved it does)."""
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from rfork.seed.seed import Seed
    from rfork.weights.adapters import adapter_identity, read_adapter
    from rfork.weights.rank_weights import RankWeights

    weights = RankWeights.from_state_dict(read_adapter(directory))
    identity = adapter_identity(base=base, name=directory.name)
    with Seed(weights=[weights], identity=identity, planner_url=planner_url):
        yield


def _start(fleet: Fleet, name: str, model: Path, rank: int, extra_env: dict[str, str]) -> _Server:
    port = free_port()
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_CI_ENV": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
        "RFORK_TCP_HOST": "127.0.0.1",
        **extra_env,
    }
    serve = [
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
        "--max-model-len", "128", "--max-num-seqs", "4", "--seed", "0", "--served-model-name", "m",
        "--enforce-eager", "--load-format", "auto",
        "--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2",
    ]  # fmt: skip
    child = fleet.spawn(name, serve, env=env, module="vllm.entrypoints.openai.api_server")
    return _Server(child, port)


def _complete(server: _Server, model: str, max_tokens: int = 1) -> list[int]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{server.port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return [int(t) for t in out["choices"][0]["token_ids"]]


def _timed(server: _Server, model: str) -> float:
    t0 = time.perf_counter()
    _complete(server, model)
    return time.perf_counter() - t0


def _drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _read_all(directory: Path) -> None:
    for f in directory.iterdir():
        f.read_bytes()


def _slug(row: str) -> str:
    return row.replace(",", "").replace(" ", "-")


def _print(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    s = results["first_request_s"]
    table = Table(
        title=f"LoRA adapter into a running vLLM (CPU): {results['size_mib']:g} MiB Llama, "
        f"rank {results['rank']} adapter of {results['adapter_bytes'] / 1e6:.1f} MB, "
        f"median of {results['repeat']}; "
        f"load average {results['load_average'][0]:.1f} -> {results['load_average'][1]:.1f}"
    )
    for col in ("first request naming it", "seconds", "fastest – slowest", "over the base"):
        table.add_column(col, justify="right")
    for row, secs in s.items():
        runs = results["runs"][row]
        table.add_row(
            row,
            f"{secs:.3f}",
            f"{min(runs):.3f} – {max(runs):.3f}",
            "" if row == "base" else f"+{secs - s['base']:.3f}",
        )
    console = Console()
    console.print(table)
    console.print(
        f"tokens equal (peer vs filesystem adapter): {'yes' if results['tokens_equal'] else 'NO'}; "
        f"page cache dropped: {'yes' if results['page_cache_dropped'] else 'no (not root): row skipped'}; "
        "the filesystem rows include rfork's resolver asking the planner first: "
        f"{'yes' if results['filesystem_rows_asked_rfork_first'] else 'no'}"
    )
