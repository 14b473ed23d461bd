"""Digest cost, in one run: host BLAKE3 (1 and 2 threads), xxh3-128 and memcpy over the same bytes,
and BLAKE3 with torch ops (rfork.weights.blake3_tensor) and pmix64-v1 on `--device`; on CUDA also the
optional Triton kernel (rfork.weights.blake3_triton), when triton imports.

GB/s are 10^9 bytes hashed (or copied) per second, best of `--repeat`; the host memory is faulted in
first. The device's BLAKE3 (each kernel) is checked against the host's at every size (`agree`). A
pull pays the digest twice (the seed at start, the loader while verifying): see docs/reliability.md.

    rfork bench digest --device cpu --sizes-gib 0.0625 0.25 [--json FILE]
    python3 -m rfork bench digest --device cuda --sizes-gib 1 2 4 --json FILE

With `--device cpu` the torch-ops BLAKE3 runs on the CPU (slow: it is meant for a GPU; keep the
sizes small). Run it under `quiet-bench` (or `flock /tmp/rfork-bench.lock`) on a shared box.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GiB = 1 << 30
HOST = ("memcpy", "xxh3-128", "blake3 1 thread", "blake3 2 threads")
DEVICE = ("blake3 torch", "blake3 triton", "pmix64-v1")


def configure(parser: argparse.ArgumentParser) -> None:
    """Options: device, sizes, repeats, JSON output."""
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the torch-ops BLAKE3 and pmix64 run (default cpu)",
    )
    parser.add_argument(
        "--sizes-gib", type=float, nargs="+", default=[1, 2, 4], help="sizes in GiB (default 1 2 4)"
    )
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
    """Measure and print one row per size; 1 if a device digest disagreed with the host's."""
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    import torch

    from rfork.weights import checksum as ck
    from rfork.weights.blake3_tensor import blake3_hex

    sizes = [int(s * GiB) for s in args.sizes_gib]
    if min(sizes) < 1 << 20 or args.repeats < 1:
        raise ValueError("--sizes-gib must be >= 1 MiB each and --repeats >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device")
    device = torch.device(args.device)
    biggest = max(sizes) // 8 * 8
    buf = torch.empty(biggest, dtype=torch.uint8)
    buf.view(torch.int64).copy_(torch.arange(biggest // 8, dtype=torch.int64) * 0x9E3779B97F4A7C15)
    dst = torch.empty_like(buf)
    dst.fill_(0)  # fault every page in
    on_device = buf.to(device) if device.type != "cpu" else buf
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    blake3_hex(on_device[: 1 << 20])  # warm-up: constants and kernels
    ck.checksum_bytes(on_device[: 1 << 20])
    triton_error = _triton_ready(device, on_device, blake3_hex)
    if triton_error:
        print(f"blake3 triton: not measured ({triton_error})")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(
        f"load average {os.getloadavg()[0]:.2f}; device {device} ({name}); torch threads "
        f"{torch.get_num_threads()}; GB/s = 10^9 bytes per second, best of {args.repeats}"
    )
    cols = (*HOST, *(f"{c} {device.type}" for c in DEVICE))
    print(f"{'GiB':>7} " + " ".join(f"{c:>17}" for c in cols) + "  agree (torch, triton)")
    rows = []
    ok = True
    for size in sizes:
        n = min(size, biggest)
        data, out, dev = buf[:n], dst[:n], on_device[:n]
        host_b3 = ck.blake3_bytes(data, threads=1)
        seconds = {
            "memcpy": _best(functools.partial(out.copy_, data), args.repeats),
            "xxh3-128": _best(functools.partial(ck.xxh3_bytes, data), args.repeats),
            "blake3 1 thread": _best(functools.partial(ck.blake3_bytes, data, threads=1), args.repeats),
            "blake3 2 threads": _best(functools.partial(ck.blake3_bytes, data, threads=2), args.repeats),
            "blake3 torch": _best(functools.partial(blake3_hex, dev, kernel="torch"), args.repeats, sync),
            "pmix64-v1": _best(functools.partial(ck.checksum_bytes, dev), args.repeats, sync),
        }
        agree = {"torch": blake3_hex(dev, kernel="torch") == host_b3}
        if not triton_error:
            triton = functools.partial(blake3_hex, dev, kernel="triton")
            seconds["blake3 triton"] = _best(triton, args.repeats, sync)
            agree["triton"] = triton() == host_b3
        ok &= all(agree.values())
        gbps = {k: n / s / 1e9 for k, s in seconds.items()}
        rows.append(
            {
                "bytes": n,
                "gib": n / GiB,
                "device": str(device),
                "seconds": seconds,
                "gbps": gbps,
                "blake3": host_b3,
                "device_blake3_agrees": agree,
            }
        )
        figures = " ".join(f"{gbps[k]:17.2f}" if k in gbps else f"{'n/a':>17}" for k in (*HOST, *DEVICE))
        print(f"{n / GiB:7.3f} {figures}  {agree['torch']} {agree.get('triton', '-')}")
    if args.json:
        doc: dict[str, Any] = {
            "device": str(device),
            "device_name": name,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "rows": rows,
            "triton": triton_error or "measured",
            "load_average": os.getloadavg(),
        }
        args.json.write_text(json.dumps(doc, indent=1))
    if not ok:
        print("the device BLAKE3 disagreed with the host's (see agree)")
    return 0 if ok else 1


def _triton_ready(device: Any, sample: Any, blake3_hex: Callable[..., str]) -> str:
    """ "" when the Triton kernel compiles and runs on `device` (CUDA only), else why not."""
    if device.type != "cuda":
        return "CUDA only"
    try:
        blake3_hex(sample[: (1 << 20) + 1], kernel="triton")  # compiles both variants (chunks, parents)
    except Exception as exc:  # noqa: BLE001 - any failure (no triton, a compile error) leaves the rest
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return ""


def _best(fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)
