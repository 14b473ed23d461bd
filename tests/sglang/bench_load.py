"""SGLang's own weight load versus the R-Fork pull, for the same model on the same machine.

    python -m tests.sglang.bench_load --size-mib 256 [--modes checkpoint,parameters] [--json FILE]

Run it in .venv-sglang. The baseline is measured in the same run: an SGLang server started with
`--load-format auto` (the page cache is warmed first, so "disk" is at its best). Then come:
- R: `rfork sglang` in checkpoint mode, pulling over tcp from a seed of the same checkpoint (an
  in-process `rfork.seed.seed.Seed`, as `rfork seed` runs it);
- with `parameters` in --modes, P1 (SGLang's own loader, then a parameters seed) and P2 (pulls into
  its parameters from P1).
Each figure is SGLang's own `Load weight end. elapsed` (the whole ModelRunner.load_model) and rfork's
own line for the pull. Servers run one at a time. It runs on CPU with the test-only rotary stand-in
(tests/sglang/doubles), so it measures the loading path, not a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from rfork.weights.synthetic import config_for_size
from tests.sglang.servers import ServerFleet, SglangServer
from tests.sglang.tiny_model import write_tiny_llama

_PULL = {
    "checkpoint": re.compile(
        r"rfork: checkpoint mode: rank \d+, (\d+) bytes from (\S+) for .* in [0-9.]+ s \(pull ([0-9.]+) s"
    ),
    "parameters": re.compile(
        r"rfork: parameters mode: rank \d+, (\d+) bytes from (\S+) for .* into .* in ([0-9.]+) s"
    ),
}


def _rfork_line(server: SglangServer, mode: str) -> tuple[int, str, float] | None:
    found = _PULL[mode].findall(server.log())
    if not found:
        return None
    nbytes, source, seconds = found[-1]
    return int(nbytes), source, float(seconds)


def _row(
    name: str, server: SglangServer, mode: str | None, reference: list[int], base_s: float
) -> dict[str, Any]:
    load_s = server.weight_load_seconds()
    pulled = _rfork_line(server, mode) if mode else None
    tokens = server.generate()
    return {
        "server": name,
        "mode": mode or "auto",
        "source": pulled[1] if pulled else ("disk (sglang)" if mode is None else "sglang-default"),
        "sglang_load_s": round(load_s, 4),
        "rfork_s": round(pulled[2], 4) if pulled else None,
        "bytes": pulled[0] if pulled else None,
        "speedup_vs_auto": round(base_s / load_s, 3) if load_s > 0 else None,
        "tokens_equal_auto": tokens == reference,
        "ready_s": round(server.ready_s or 0.0, 2),
    }


def _checkpoint_seed(model: Path, planner_url: str) -> Any:
    from rfork.seed.seed import Seed
    from rfork.weights.checkpoint import load_state_dict, read_checkpoint_info
    from rfork.weights.rank_weights import RankWeights

    info = read_checkpoint_info(model)
    weights = RankWeights.from_tensors(rank=0, tensors=load_state_dict(model))
    return Seed(weights=[weights], identity=info.identity(tp=1), planner_url=planner_url)


def _start(fleet: ServerFleet, name: str, planner_url: str, mode: str) -> SglangServer:
    return fleet.start_rfork(name, planner_url=planner_url, mode=mode).wait_ready()


def run(size_mib: int, modes: list[str], workdir: Path) -> dict[str, Any]:
    from planner import PlannerServer

    os.environ.setdefault("RFORK_TCP_HOST", "127.0.0.1")  # loopback, as the servers use
    config = config_for_size(size_mib << 20)
    model = write_tiny_llama(workdir / "model", name=f"bench-llama-{size_mib}mib", config=config)
    model_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    for p in model.glob("*.safetensors"):  # warm the page cache: the baseline reads memory, not a disk
        p.read_bytes()
    fleet = ServerFleet(workdir / "servers", model)
    (workdir / "servers").mkdir(exist_ok=True)
    rows: list[dict[str, Any]] = []
    with PlannerServer(db_url=f"sqlite:///{workdir / 'planner.db'}", insecure=True) as planner:
        try:
            auto = fleet.start_auto("auto").wait_ready()
            reference = auto.generate()
            base_s = auto.weight_load_seconds()
            rows.append(_row("auto", auto, None, reference, base_s))
            auto.stop()
            if "checkpoint" in modes:
                with _checkpoint_seed(model, planner.url):
                    r = _start(fleet, "R", planner.url, "checkpoint")
                    rows.append(_row("R (pull from seed)", r, "checkpoint", reference, base_s))
                    r.stop()
            if "parameters" in modes:
                p1 = _start(fleet, "P1", planner.url, "parameters")
                rows.append(_row("P1 (no seed)", p1, "parameters", reference, base_s))
                p2 = _start(fleet, "P2", planner.url, "parameters")
                rows.append(_row("P2 (pull from P1)", p2, "parameters", reference, base_s))
        finally:
            fleet.close()
    return {
        "model": {"hidden": config.hidden_size, "layers": config.num_hidden_layers, "bytes": model_bytes},
        "rows": rows,
        "load_average": list(os.getloadavg()),
        "machine": f"{os.cpu_count()} cpus, shared",
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size-mib", type=int, default=256, help="model size in MiB (bf16 Llama)")
    parser.add_argument("--modes", default="checkpoint,parameters", help="checkpoint and/or parameters")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    with tempfile.TemporaryDirectory(prefix="rfork-sglang-bench-") as tmp:
        out = run(args.size_mib, modes, Path(tmp))
    m = out["model"]
    print(f"model: hidden {m['hidden']}, {m['layers']} layers, {m['bytes'] / 1e6:.1f} MB; "
          f"load average {out['load_average'][0]:.2f} (shared machine)")
    print(f"{'server':<20} {'source':<16} {'SGLang load s':>14} {'rfork s':>9} {'vs auto':>8} {'tokens=':>8}")
    for r in out["rows"]:
        rf = "" if r["rfork_s"] is None else f"{r['rfork_s']:.3f}"
        print(f"{r['server']:<20} {r['source']:<16} {r['sglang_load_s']:>14.3f} {rf:>9} "
              f"{r['speedup_vs_auto']:>7.2f}x {str(r['tokens_equal_auto']):>8}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
