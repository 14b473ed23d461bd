"""A serving framework's startup, reduced to what loading touches: `rfork bench cold-start --dest
initialized` runs one per measurement.

Like an inference engine with a dummy-weights init (SGLang's R-Fork path), it starts the loader
first (engine opening on a helper thread), builds the model's tensors from the checkpoint's shapes
and initialises them, then fills them in place: `Loader.pull_into` from a seed, or `read_rank_into`
from the checkpoint for the disk row. Only the fill is timed (`seconds`); the JSON it writes has
the keys of `rfork load --json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    parser = argparse.ArgumentParser(prog="python -m bench.framework_child")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument(
        "--source",
        required=True,
        help="disk, runai (Run:ai Model Streamer), or a one-sided provider (tcp, shm)",
    )
    parser.add_argument("--planner", default=None)
    parser.add_argument("--exclude", action="append", default=[], help="never pull from this instance id")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time);
    # the disk row imports only what a disk load needs (process start is part of what it measures)
    from backends.layout import dtype_from_name
    from rfork.weights.checkpoint import read_checkpoint_info, read_rank_into

    info = read_checkpoint_info(args.checkpoint)
    loader = None
    if args.source not in ("disk", "runai"):
        from rfork.loader import Loader
        from rfork.pull.options import LoadOptions

        if not args.planner:
            raise SystemExit("--planner is needed for a one-sided source")
        loader = Loader(
            identity=info.identity(),
            planner_url=args.planner,
            checkpoint=info,
            options=LoadOptions(
                providers=[args.source],
                become_seed=False,
                allow_nccl=args.source == "nccl",
                exclude=args.exclude,
            ),
        )
        loader.prepare()  # the engine opens while the model is built, as a framework hook does
    tensors = {t.name: torch.empty(t.shape, dtype=dtype_from_name(t.dtype)) for t in info.tensors}
    for t in tensors.values():
        t.fill_(0)  # the dummy init: every parameter page is written before the weights arrive
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    if args.source == "runai":
        runai_read_into(info, tensors)
        source, verified, nbytes = "runai", False, info.total_bytes
    elif loader is None:
        read_rank_into(info, tensors)
        source, verified, nbytes = "disk", False, info.total_bytes
    else:
        result = loader.pull_into(tensors)
        source, verified, phases, nbytes = result.source, result.verified, result.phases, result.bytes
        result.close()
    seconds = time.perf_counter() - t0
    verified_at = time.time()
    doc = {
        "source": source,
        "bytes": nbytes,
        "seconds": seconds,
        "gb_per_s": nbytes / max(seconds, 1e-9) / 1e9,
        "verified": verified,
        "since_start_s": verified_at - started,
        "verified_at": verified_at,
        "phases": phases,
    }
    tmp = args.json.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, allow_nan=False))
    tmp.replace(args.json)
    return 0


def runai_read_into(info: Any, tensors: dict[str, Any]) -> None:
    """Run:ai Model Streamer (PyPI runai-model-streamer): its concurrent reads of the safetensors files
    into its CPU buffer, each tensor it yields copied into the framework's tensor (as vLLM's
    `--load-format runai_streamer` does before moving them to the device)."""
    from runai_model_streamer import SafetensorsStreamer

    files = [str(f) for f in info.files]
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(files)
        for name, tensor in streamer.get_tensors():
            tensors[name].copy_(tensor)


if __name__ == "__main__":
    sys.exit(main())
