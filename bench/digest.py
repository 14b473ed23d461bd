"""Digest cost: seconds to hash 1, 2 and 4 GiB with xxh3-128 and BLAKE3, against the same run's memcpy.

One thread, as the loader's verifier thread hashes; the memory is faulted in first, best of the
repeats. A pull pays the digest twice (the seed at start, the loader while verifying): see
docs/reliability.md. Run it under `flock /tmp/rfork-bench.lock` on a shared box.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

GiB = 1 << 30


def configure(parser: argparse.ArgumentParser) -> None:
    """Options: sizes, repeats, JSON output."""
    parser.add_argument("--sizes-gib", type=int, nargs="+", default=[1, 2, 4], help="sizes (default 1 2 4)")
    parser.add_argument(
        "--repeat",
        "--repeats",
        dest="repeats",
        type=int,
        default=2,
        help="runs per figure; the best is shown",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")


def run(args: argparse.Namespace) -> int:
    """Measure and print one row per size."""
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    import torch

    from rfork.weights import checksum as ck

    if min(args.sizes_gib) < 1 or args.repeats < 1:
        raise ValueError("--sizes-gib and --repeats must be >= 1")
    buf = torch.empty(max(args.sizes_gib) * GiB, dtype=torch.uint8)
    buf.view(torch.int64).copy_(torch.arange(buf.numel() // 8, dtype=torch.int64))  # fault every page in
    dst = torch.empty_like(buf)
    dst.fill_(0)
    rows = []
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'GiB':>4} {'memcpy s':>9} {'xxh3-128 s':>11} {'blake3 s':>9} {'blake3 - xxh3 s':>16}")
    for size in args.sizes_gib:
        data = buf[: size * GiB]
        out = dst[: data.numel()]
        figures = {
            "memcpy": _best(functools.partial(out.copy_, data), args.repeats),
            ck.XXH3_128: _best(functools.partial(ck.xxh3_bytes, data), args.repeats),
            ck.BLAKE3: _best(functools.partial(ck.blake3_bytes, data), args.repeats),
        }
        rows.append({"gib": size, **figures})
        print(
            f"{size:>4} {figures['memcpy']:9.3f} {figures[ck.XXH3_128]:11.3f} {figures[ck.BLAKE3]:9.3f}"
            f" {figures[ck.BLAKE3] - figures[ck.XXH3_128]:16.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "load_average": os.getloadavg()}, indent=1))
    return 0


def _best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
