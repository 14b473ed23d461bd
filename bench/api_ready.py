"""API-ready time of a real vLLM server on CPU: cold, R-Fork weights only, R-Fork weights + compile cache.

"API-ready" here is process start to the first generated token (a one-token completion right after
`/health` answers). One run, rows side by side, each a fresh server process with its own empty
`VLLM_CACHE_ROOT` and torch.compile on (inductor, g++):
- cold: `--load-format auto` (weights from disk, nothing cached);
- weights: `rfork vllm --no-compile-cache`, weights pulled from a running replica, vLLM compiles;
- weights + caches: `rfork vllm`, weights and the replica's compile cache pulled before vLLM compiles.
The replica is a `rfork vllm` server started first (it compiles and serves both); it is the setup,
not a row. Breakdown from the server's log: the model load ("Starting to load model" to the compile
warm-up, log timestamps at 1 s resolution: build, weights, post-processing, rfork's seed and cache
fetch, the fetch also on its own from rfork's line), engine init (profile run, which compiles on
CPU, KV cache, warm-up: "init engine ... took"), the compile share of it ("Warming up model for the
compilation" to "Warming up done", 1 s resolution), imports and set-up (the rest until `/health`),
the first request, and the C++ kernels inductor built (rfork.compile_cache.vllm_log). Runs where
vLLM is installed (.venv-vllm).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.processes import Fleet, free_port, wait_healthy
from rfork.compile_cache.vllm_log import CompileEvidence, kernels_built_since

ROWS = ("cold", "weights", "weights+caches")
_STAMP = r"(\d\d-\d\d \d\d:\d\d:\d\d)"


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork bench api-ready`."""
    parser.add_argument("--size-mib", type=float, default=64.0, help="synthetic Llama size (default 64 MiB)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep model, logs, caches here")
    parser.add_argument("--timeout", type=float, default=900.0, help="per server start, seconds")
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    # imported here: `rfork bench --help` start-up stays instant (bench.commands)
    from planner import PlannerServer
    from rfork.weights.synthetic import config_for_size, write_servable_llama

    work = args.workdir or Path(tempfile.mkdtemp(prefix="rfork-api-ready-"))
    work.mkdir(parents=True, exist_ok=True)
    config = config_for_size(int(args.size_mib * (1 << 20)))
    model = write_servable_llama(work / "model", config=config, name="api-ready-llama")
    load_before = os.getloadavg()
    results: dict[str, Any] = {"size_mib": args.size_mib, "load_before": load_before, "rows": {}}
    fleet = Fleet(work / "logs")
    try:
        with PlannerServer(db_url=f"sqlite:///{work / 'planner.db'}", insecure=True) as planner:
            replica = _start(fleet, "replica", model, work, planner.url, rfork_args=[])
            wait_healthy(replica.child, replica.port, args.timeout)
            _first_token(replica.port)
            time.sleep(3.0)  # the replica packs its compile cache once nothing was written for 2 s
            results["replica"] = _figures(replica, 0.0, 0.0)
            for row, rfork_args in (
                ("cold", None),
                ("weights", ["--no-compile-cache", "--no-serve"]),
                ("weights+caches", ["--no-serve"]),
            ):
                server = _start(fleet, row, model, work, planner.url, rfork_args=rfork_args)
                ready = wait_healthy(server.child, server.port, args.timeout)
                first = _first_token(server.port) - server.started
                results["rows"][row] = _figures(server, ready, first)
                fleet.stop(server.child, grace_s=20.0)
    finally:
        fleet.close()
    results["load_after"] = os.getloadavg()
    print(_table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


class _Server:
    def __init__(self, child: Any, port: int, cache_root: Path) -> None:
        self.child = child
        self.port = port
        self.started = child.started
        self.cache_root = cache_root


def _start(
    fleet: Fleet, name: str, model: Path, work: Path, planner_url: str, *, rfork_args: list[str] | None
) -> _Server:
    port = free_port()
    cache_root = work / f"cache-{name}"
    env = {
        "VLLM_CACHE_ROOT": str(cache_root),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
        "RFORK_TCP_HOST": "127.0.0.1",
    }
    serve = [
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
        "--max-model-len", "128", "--max-num-seqs", "4", "--seed", "0", "--served-model-name", "m",
    ]
    if rfork_args is None:
        child = fleet.spawn(name, [*serve, "--load-format", "auto"], env=env,
                            module="vllm.entrypoints.openai.api_server")
    else:
        argv = ["vllm", "--planner", planner_url, "--insecure", *rfork_args, "--", *serve]
        child = fleet.spawn(name, argv, env=env)
    return _Server(child, port, cache_root)


def _first_token(port: int) -> float:
    """Wall-clock time (time.time()) when a one-token greedy completion came back."""
    body = {"model": "m", "prompt": [1, 17, 42, 99], "max_tokens": 1, "temperature": 0.0}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        resp.read()
    return time.time()


def _figures(server: _Server, ready_s: float, first_token_s: float) -> dict[str, Any]:
    """The row's breakdown and cache evidence, from its log."""
    text = server.child.log_path.read_text(errors="replace")
    ev = CompileEvidence.from_log(text)
    # the CPU runner logs no "Model loading took": its load is the span from "Starting to load model"
    # to the compile warm-up (building the model, the weights, post-processing, rfork's seed and fetch)
    load_s = _between(text, "Starting to load model", "Warming up model for the compilation")
    fetch = re.findall(r"installed from \S+: \d+ new file\(s\), \d+ bytes, ([0-9.]+) s", text)
    init_s = ev.init_engine_s
    compile_s = _between(text, "Warming up model for the compilation", "Warming up done")
    setup_s = ready_s - (load_s or 0.0) - (init_s or 0.0) if ready_s else None
    return {
        "api_ready_s": first_token_s,
        "health_s": ready_s,
        "imports_setup_s": setup_s,
        "load_s": load_s,
        "cache_fetch_s": float(fetch[-1]) if fetch else None,
        "engine_init_s": init_s,
        "compile_s": compile_s,
        "warmup_other_s": None if init_s is None or compile_s is None else init_s - compile_s,
        "first_request_s": first_token_s - ready_s if ready_s else None,
        "vllm_compiled": ev.compiled,
        "vllm_used_cache": ev.used_cache,
        "aot_load_failures": ev.aot_load_failures,
        "cache_installed": "installed from" in text,
        "kernels_built": kernels_built_since(server.cache_root, server.started),
    }


def _between(text: str, start: str, end: str) -> float | None:
    """Seconds between the log lines holding `start` and `end` (vLLM's timestamps: 1 s resolution)."""
    a = re.search(_STAMP + r"[^\n]*" + re.escape(start), text)
    b = re.search(_STAMP + r"[^\n]*" + re.escape(end), text)
    if a is None or b is None:
        return None
    fmt = "%m-%d %H:%M:%S"
    return (dt.datetime.strptime(b.group(1), fmt) - dt.datetime.strptime(a.group(1), fmt)).total_seconds()


def _table(results: dict[str, Any]) -> str:
    cols = [
        ("API-ready s", "api_ready_s"), ("imports+setup", "imports_setup_s"), ("load (log)", "load_s"),
        ("engine init", "engine_init_s"), ("compile (log)", "compile_s"), ("first req", "first_request_s"),
        ("cache fetch", "cache_fetch_s"), ("kernels built", "kernels_built"),
    ]
    rows = results["rows"]
    base = rows.get("cold", {}).get("api_ready_s")
    lines = [
        f"rfork bench api-ready: vLLM on CPU, {results['size_mib']:g} MiB Llama, "
        f"load {results['load_before'][0]:.1f} -> {results['load_after'][0]:.1f}",
        f"{'row':16}" + "".join(f"{c:>15}" for c, _ in cols) + f"{'vs cold':>9}  cache",
    ]
    for name in ROWS:
        r = rows.get(name)
        if r is None:
            continue
        cells = "".join(f"{_num(r[k]):>15}" for _, k in cols)
        ratio = f"{base / r['api_ready_s']:.2f}x" if base and r["api_ready_s"] else ""
        used = "installed" if r["cache_installed"] else "none"
        if r["aot_load_failures"]:
            used += ", AOT artifact found (load failed)"
        lines.append(f"{name:16}{cells}{ratio:>9}  {used}")
    return "\n".join(lines)


def _num(x: float | None) -> str:
    if isinstance(x, int):
        return str(x)
    return "" if x is None else f"{x:.2f}"
