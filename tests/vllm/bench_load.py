"""vLLM's own load versus the R-Fork load, for the same checkpoint on the same machine.

    flock /tmp/rfork-bench.lock .venv-vllm/bin/python -m tests.vllm.bench_load --size-mib 256 \\
        [--rounds 3] [--json F]

Run it in .venv-vllm. Each row is a fresh process running `vllm.LLM` on CPU (engine and worker in
that process), and the figure is the wall time of vLLM's own `get_model(vllm_config)` call in its
CPU model runner: building the model, loading the weights, post-processing them. Rows:
- auto, cold: `--load-format auto` after the checkpoint's pages were dropped from the page cache
  (posix_fadvise DONTNEED on each file: no root needed; the disk is whatever backs the temp dir);
- auto, warm: the same with the files in the page cache;
- R: `--load-format rfork`, checkpoint mode, pulling over tcp from a seed of the checkpoint (an
  in-process `rfork.seed.seed.Seed`, as `rfork seed` runs it); the checkpoint's pages are dropped
  first, and rfork reads only the headers;
- P1: parameters mode with no parameters seed (vLLM's disk loader fills the parameters, warm), then
  it stays up as the parameters seed;
- P2: parameters mode, pulling into its parameters from P1, then a seed itself (the default).
Every row also generates greedy tokens for one prompt; they must equal the cold auto row's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rfork.weights.synthetic import config_for_size
from tests.vllm.servers import NEW_TOKENS, PROMPT, cpu_env, write_vllm_tiny_llama

_CHILD_MARK = "RFORK-BENCH-ROW "
# rfork's own line for the pull (or disk read) inside the load: bytes, source, seconds
_PULLED = re.compile(r"loaded 1 rank\(s\), (\d+) bytes(?: \(\d+ kept\))?, from (\S+) in ([0-9.]+) s")


def drop_page_cache(model: Path) -> None:
    """Evict the checkpoint's files from the page cache (clean pages; what `rfork` or vLLM reads next
    comes from the disk)."""
    for p in model.glob("*.safetensors"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_page_cache(model: Path) -> None:
    for p in model.glob("*.safetensors"):
        p.read_bytes()


def child(model: str, load_format: str, extra: dict[str, Any], hold: bool) -> None:
    """One row, in this process: time vLLM's `get_model`, generate, print the result as one line."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    import vllm
    from vllm.v1.worker import cpu_model_runner

    timed: dict[str, float] = {}
    get_model = cpu_model_runner.get_model

    def timed_get_model(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return get_model(*args, **kwargs)
        finally:
            timed["get_model_s"] = time.perf_counter() - t0

    cpu_model_runner.get_model = timed_get_model  # bench-only: measure vLLM's own load call
    llm = vllm.LLM(
        model=model,
        load_format=load_format,
        model_loader_extra_config=extra,
        dtype="bfloat16",
        max_model_len=128,
        max_num_seqs=4,
        enforce_eager=True,
        seed=0,
        distributed_executor_backend="uni",
    )
    params = vllm.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    row = {"get_model_s": timed.get("get_model_s"), "tokens": list(out[0].outputs[0].token_ids)}
    print(_CHILD_MARK + json.dumps(row), flush=True)
    if hold:  # stay up as a seed until the parent closes stdin
        sys.stdin.read()


def _run_row(model: Path, load_format: str, extra: dict[str, Any], log: Path, *, hold: bool = False
             ) -> tuple[dict[str, Any], subprocess.Popen[str]]:
    env = {**cpu_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    argv = [sys.executable, "-m", "tests.vllm.bench_load", "--child", str(model), load_format,
            json.dumps(extra)]
    if hold:
        argv.append("--hold")
    with log.open("w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.PIPE, text=True,
                                env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(_CHILD_MARK):
            row: dict[str, Any] = json.loads(line[len(_CHILD_MARK):])
            if not hold:
                proc.wait(timeout=600)
            pulled = _PULLED.findall(log.read_text())
            if pulled:
                row["rfork_source"], row["rfork_pull_s"] = pulled[-1][1], float(pulled[-1][2])
            return row, proc
    proc.wait(timeout=60)
    raise RuntimeError(f"{load_format} row failed ({proc.returncode}):\n{log.read_text()[-4000:]}")


def run(size_mib: int, workdir: Path, rounds: int) -> dict[str, Any]:
    """Every row once per round, rounds in sequence; each row's figure is its median over the rounds
    (this VM's first-touch costs move single runs by tens of percent)."""
    from planner import PlannerServer
    from rfork.seed.seed import Seed
    from rfork.weights.checkpoint import load_state_dict, read_checkpoint_info
    from rfork.weights.rank_weights import RankWeights

    os.environ.setdefault("RFORK_TCP_HOST", "127.0.0.1")
    config = config_for_size(size_mib << 20)
    model = write_vllm_tiny_llama(workdir / "model", config=config)
    model_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    runs: dict[str, list[dict[str, Any]]] = {}

    def add(name: str, row: dict[str, Any]) -> None:
        runs.setdefault(name, []).append({**row, "load_average": round(os.getloadavg()[0], 2)})

    for n in range(rounds):
        drop_page_cache(model)
        add("auto, page cache dropped", _run_row(model, "auto", {}, workdir / "auto-cold.log")[0])
        warm_page_cache(model)
        add("auto, page cache warm", _run_row(model, "auto", {}, workdir / "auto-warm.log")[0])
        with PlannerServer(db_url=f"sqlite:///{workdir / f'planner-{n}.db'}", insecure=True) as planner:
            info = read_checkpoint_info(model)
            weights = RankWeights.from_tensors(rank=0, tensors=load_state_dict(model))
            ckpt = {"planner_url": planner.url, "mode": "checkpoint", "serve": False}
            with Seed(weights=[weights], identity=info.identity(tp=1), planner_url=planner.url):
                drop_page_cache(model)
                add("R: checkpoint mode, pull from a seed",
                    _run_row(model, "rfork", ckpt, workdir / "r.log")[0])
            del weights
            params = {"planner_url": planner.url, "mode": "parameters"}
            warm_page_cache(model)
            p1_row, p1 = _run_row(model, "rfork", params, workdir / "p1.log", hold=True)
            try:
                add("P1: parameters mode, no seed (disk, warm)", p1_row)
                add("P2: parameters mode, pull from P1",
                    _run_row(model, "rfork", params, workdir / "p2.log")[0])
            finally:
                assert p1.stdin is not None
                p1.stdin.close()
                p1.wait(timeout=120)
    reference = runs["auto, page cache dropped"][0]["tokens"]
    rows = []
    for name, got in runs.items():
        pulls = [r["rfork_pull_s"] for r in got if r.get("rfork_pull_s") is not None]
        rows.append({
            "row": name,
            "get_model_s": round(statistics.median(r["get_model_s"] for r in got), 4),
            "get_model_runs_s": [round(r["get_model_s"], 4) for r in got],
            "rfork_source": got[-1].get("rfork_source"),
            "rfork_pull_s": round(statistics.median(pulls), 4) if pulls else None,
            "tokens_equal_auto": all(r["tokens"] == reference for r in got),
            "load_average": max(r["load_average"] for r in got),
        })
    for r in rows:
        r["vs_auto_cold"] = round(rows[0]["get_model_s"] / r["get_model_s"], 3)
        r["vs_auto_warm"] = round(rows[1]["get_model_s"] / r["get_model_s"], 3)
    return {
        "model": {"hidden": config.hidden_size, "layers": config.num_hidden_layers, "bytes": model_bytes},
        "rounds": rounds,
        "rows": rows,
        "machine": f"{os.cpu_count()} cpus, shared",
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size-mib", type=int, default=256, help="model size in MiB (bf16 Llama)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every row; the table shows medians")
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "FORMAT", "EXTRA"), help=argparse.SUPPRESS)
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], json.loads(args.child[2]), args.hold)
        return 0
    workdir = os.environ.get("RFORK_BENCH_DIR")  # default: the temp dir (its disk backs the cold rows)
    with tempfile.TemporaryDirectory(prefix="rfork-vllm-bench-", dir=workdir) as tmp:
        out = run(args.size_mib, Path(tmp), args.rounds)
    m = out["model"]
    print(f"model: hidden {m['hidden']}, {m['layers']} layers, {m['bytes'] / 1e6:.1f} MB (shared machine); "
          f"medians of {out['rounds']} round(s)")
    print(f"{'row':<44} {'get_model s':>12} {'vs auto cold':>13} {'vs auto warm':>13} {'rfork pull s':>13} "
          f"{'tokens=':>8} {'load avg':>9}")
    for r in out["rows"]:
        pull = "" if r["rfork_pull_s"] is None else f"{r['rfork_pull_s']:.3f} ({r['rfork_source']})"
        same = str(r["tokens_equal_auto"])
        print(f"{r['row']:<44} {r['get_model_s']:>12.3f} {r['vs_auto_cold']:>12.2f}x "
              f"{r['vs_auto_warm']:>12.2f}x {pull:>13} {same:>8} {r['load_average']:>9.2f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
