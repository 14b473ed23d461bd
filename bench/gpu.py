"""GPU cold-start benchmark: disk->GPU against R-Fork over CUDA IPC and over tcp with host staging.

Measured in one run (GB/s are 10^9 bytes per second of weights landed in GPU memory):
- ``d2d``: one device-to-device copy_ of the same size, the physical baseline;
- ``disk->gpu``: safetensors.torch.load_file(device="cuda") over a synthetic Llama checkpoint, once
  after asking the kernel to drop the files from the page cache (posix_fadvise DONTNEED; the table
  says whether that succeeded) and once warm;
- ``rfork cuda-ipc``: a seed process holding the weights in GPU memory exports them
  (backends.gpu.cuda_ipc); this process opens the handle and copies on its own stream;
- ``rfork tcp+staging``: the same seed serves a pinned host mirror over the tcp TransferEngine; this
  process reads through backends.gpu.staging into GPU memory.
Every R-Fork result is checked against the seed's pmix64 checksum computed on the GPU.

Run: ``python -m bench.gpu --size-gib 8 [--json FILE]``. Without CUDA it exits with status 2
and one line of error. Written without a GPU at hand: not run on a GPU yet (see docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

GIB = 1 << 30


def configure(parser: argparse.ArgumentParser) -> None:
    """Options: checkpoint size, where to put it, staging settings, JSON output."""
    parser.add_argument("--size-gib", type=float, default=8.0, help="checkpoint size in GiB (default 8)")
    parser.add_argument(
        "--dir",
        default=None,
        help="checkpoint directory (reused if it holds one; "
        "default: a temporary directory, removed afterwards)",
    )
    parser.add_argument("--bounce-mib", type=int, default=16, help="tcp staging bounce slot size in MiB")
    parser.add_argument("--depth", type=int, default=2, help="tcp staging bounce slots (double buffering: 2)")
    parser.add_argument("--domains", type=int, default=4, help="tcp TransferEngine domains")
    parser.add_argument("--skip-tcp", action="store_true", help="leave out R-Fork over tcp with staging")
    parser.add_argument("--json", dest="json_file", default=None, help="write the results to this JSON file")


def _seconds(fn: Any) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _drop_page_cache(files: Sequence[Path]) -> bool:
    """Ask the kernel to forget the files' cached pages; True if every call succeeded."""
    ok = True
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            ok = False
    return ok


def measure_d2d(nbytes: int, device: torch.device) -> float:
    """Seconds for one device-to-device copy of nbytes (best of 3, after a warm-up)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return min(_seconds(lambda: dst.copy_(src)) for _ in range(3))


def measure_disk_to_gpu(files: Sequence[Path], device: torch.device, *, cold: bool) -> tuple[float, str]:
    """Seconds to load every safetensors shard into GPU memory, and the page-cache state it ran in."""

    from safetensors.torch import load_file

    state = "warm (page cache)"
    if cold:
        state = "cold (fadvise DONTNEED)" if _drop_page_cache(files) else "unknown (fadvise failed)"
    loaded: list[dict[str, torch.Tensor]] = []
    dt = _seconds(lambda: loaded.extend(load_file(str(f), device=str(device)) for f in files))
    loaded.clear()
    return dt, state


def _seed_main(conn: Connection, nbytes: int, device_index: int, tcp: bool, domains: int) -> None:
    """Seed process: weights in GPU memory, exported over CUDA IPC and (a pinned mirror) over tcp."""
    import torch

    os.environ.setdefault("FI_TCP_IFACE", "lo")
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from backends.gpu.cuda_ipc import CudaIpcEngine
    from backends.gpu.staging import host_mirror
    from rfork.weights.checksum import checksum_bytes

    dev = torch.device("cuda", device_index)
    weights = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    g = torch.Generator(device=dev).manual_seed(7)
    step = 256 << 20
    for k in range(0, nbytes, step):
        n = min(step, nbytes - k)
        weights[k : k + n] = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev, generator=g)
    torch.cuda.synchronize()
    ipc = CudaIpcEngine(dev)
    ipc_desc = ipc.register(weights, "read").descriptor.to_bytes()
    tcp_desc = b""
    eng: Any = None
    mirror: torch.Tensor | None = None
    if tcp:
        from backends import TransferEngine

        mirror = host_mirror(weights)
        eng = TransferEngine("tcp", domains, host="127.0.0.1", timeout_s=30.0)
        tcp_desc = eng.register(mirror, "read").descriptor.to_bytes()
    conn.send((ipc_desc, tcp_desc, checksum_bytes(weights)))
    conn.recv()
    if eng is not None:
        eng.close()
    ipc.close()
    del mirror


def _rfork_runs(nbytes: int, device: torch.device, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from backends.gpu.cuda_ipc import CudaIpcEngine
    from rfork.weights.checksum import checksum_bytes

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_seed_main,
        args=(child, nbytes, device.index or 0, not args.skip_tcp, args.domains),
        daemon=True,
    )
    proc.start()
    rows: list[dict[str, Any]] = []
    try:
        if not parent.poll(600):
            raise RuntimeError("the seed process did not come up within 600 s")
        ipc_desc, tcp_desc, want = parent.recv()
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        with CudaIpcEngine(device) as eng:
            reg = eng.register(dst, "write")
            t_open = _seconds(lambda: eng.read(reg, 0, 4096, ipc_desc, 0).result(120))
            dt = _seconds(lambda: eng.read(reg, 0, nbytes, ipc_desc, 0).result(600))
            ok = checksum_bytes(dst) == want
            rows.append({"source": "rfork cuda-ipc", "seconds": dt, "open_seconds": t_open, "verified": ok})
        if tcp_desc:
            from backends import TransferEngine
            from backends.gpu.staging import StagedReader

            dst.zero_()
            with (
                TransferEngine("tcp", args.domains, host="127.0.0.1", timeout_s=30.0) as teng,
                StagedReader(teng, bounce_bytes=args.bounce_mib << 20, depth=args.depth, device=device) as rd,
            ):
                rd.read_into(dst, 0, 4096, tcp_desc, 0).result(120)  # connect
                dt = _seconds(lambda: rd.read_into(dst, 0, nbytes, tcp_desc, 0).result(3600))
            ok = checksum_bytes(dst) == want
            rows.append(
                {
                    "source": "rfork tcp+staging",
                    "seconds": dt,
                    "verified": ok,
                    "bounce_mib": args.bounce_mib,
                    "depth": args.depth,
                }
            )
        parent.send("done")
        proc.join(120)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    return rows


def run(args: argparse.Namespace) -> int:
    """Run every measurement, print a table, optionally write JSON; 2 without CUDA."""
    import torch

    if not torch.cuda.is_available():
        print(
            "error: bench.gpu needs a CUDA GPU (torch.cuda.is_available() is false here)",
            file=sys.stderr,
        )
        return 2
    if args.size_gib <= 0:
        print(f"error: --size-gib must be positive, not {args.size_gib}", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.table import Table

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from rfork.weights.checkpoint import read_checkpoint_info
    from rfork.weights.synthetic import write_synthetic_checkpoint

    device = torch.device("cuda", torch.cuda.current_device())
    tmp = None
    directory = Path(args.dir) if args.dir else Path(tmp := tempfile.mkdtemp(prefix="rfork-gpu-bench-"))
    try:
        if not (directory / "config.json").exists():
            write_synthetic_checkpoint(directory, size_bytes=int(args.size_gib * GIB))
        info = read_checkpoint_info(directory)
        nbytes = info.total_bytes
        files = sorted({info.files[t.region] for t in info.tensors})
        rows: list[dict[str, Any]] = [
            {"source": "d2d copy (baseline)", "seconds": measure_d2d(nbytes, device)}
        ]
        torch.cuda.empty_cache()
        for cold in (True, False):
            dt, state = measure_disk_to_gpu(files, device, cold=cold)
            torch.cuda.empty_cache()
            rows.append({"source": "disk->gpu safetensors", "seconds": dt, "page_cache": state})
        rows += _rfork_runs(nbytes, device, args)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    d2d = rows[0]["seconds"]
    disk_cold = rows[1]["seconds"]
    for r in rows:
        r["gb_per_s"] = nbytes / r["seconds"] / 1e9
        r["vs_d2d"] = d2d / r["seconds"]
        r["speedup_vs_disk_cold"] = disk_cold / r["seconds"]
    props = torch.cuda.get_device_properties(device)
    machine = {
        "gpu": props.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "bytes": nbytes,
    }
    table = Table(
        title=f"rfork GPU cold start: {nbytes / GIB:.2f} GiB on {props.name} "
        f"(torch {torch.__version__}, CUDA {torch.version.cuda})"
    )
    for col in ("source", "page cache", "seconds", "GB/s", "x of d2d", "speed-up vs cold disk", "verified"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["source"],
            r.get("page_cache", ""),
            f"{r['seconds']:.3f}",
            f"{r['gb_per_s']:.2f}",
            f"{r['vs_d2d']:.2f}",
            f"{r['speedup_vs_disk_cold']:.1f}",
            str(r.get("verified", "")),
        )
    Console().print(table)
    if args.json_file:
        doc = {"machine": machine, "rows": rows}
        Path(args.json_file).write_text(json.dumps(doc, indent=1, allow_nan=False))
    return 0 if all(r.get("verified", True) for r in rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: parse argv and run."""
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
