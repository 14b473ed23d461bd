"""GPU cold start: disk->GPU against R-Fork by CUDA IPC and by pinned-host staging over tcp and shm.

Measured in one run, two processes on one GPU (GB/s are 10^9 bytes of weights landed in GPU memory
per second):
- baselines: one device-to-device ``copy_`` of the same bytes, and one pinned host-to-device copy;
- ``disk->gpu``: ``safetensors.torch.load_file(device="cuda")`` over a synthetic Llama checkpoint of
  the same size, once with the page cache dropped (``/proc/sys/vm/drop_caches`` as root, else
  ``posix_fadvise(DONTNEED)``; the row says which, and how much of the files was still resident as
  mincore saw it), and once warm;
- R-Fork: a seed process holding bf16 weights in GPU memory; this process pulls them by CUDA IPC
  (the cuda-python driver backend and torch's), and through pinned bounce slots over tcp and shm
  (bench.gpu_peers), each verified against the seed's device digest;
- the device digest: GB/s on the GPU over the pulled bytes, and equality with the same algorithm on
  the CPU over the first ``--digest-check-gib`` of them.
Then the goals (bench.gpu_report), a table, and ``--json``.

Run: ``rfork bench gpu --size-gib 8 [--json FILE]`` (``python -m bench.gpu`` from a checkout).
Without CUDA it exits with status 2 and one line of error. A path that fails is left out of the
table and named under "errors" (exit status 1), so one broken path cannot hide the others' figures.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import gpu_report as report
from bench.gpu_peers import _sync_seconds, fill_bf16, rfork_rows

if TYPE_CHECKING:
    import torch

GIB = 1 << 30
PATHS = ("ipc", "tcp", "shm", "disk")


def configure(parser: argparse.ArgumentParser) -> None:
    """Options: checkpoint size, where to put it, staging settings, what to skip, JSON output."""
    parser.add_argument("--size-gib", type=float, default=8.0, help="weights size in GiB (default 8)")
    parser.add_argument(
        "--dir", default=None,
        help="checkpoint directory (reused if it holds one; default: a temporary one, removed afterwards)",
    )
    parser.add_argument("--bounce-mib", type=int, default=32, help="staging bounce slot in MiB (default 32)")
    parser.add_argument("--depth", type=int, default=3, help="staging bounce slots (default 3)")
    parser.add_argument("--domains", type=int, default=4, help="engine domains for tcp and shm (default 4)")
    parser.add_argument("--skip", nargs="*", default=[], choices=PATHS, help="leave these paths out")
    parser.add_argument("--digest-check-gib", type=float, default=1.0,
                        help="GiB digested on the CPU too, to compare with the GPU's result (default 1)")
    parser.add_argument("--json", dest="json_file", default=None, help="write the results to this JSON file")
    parser.add_argument("--rehearse-on-cpu", action="store_true",
                        help="run this bench's code on the CPU (no CUDA IPC) to check it without a GPU; "
                        "its figures mean nothing")


def _seconds(fn: Any) -> float:
    return _sync_seconds(fn)


# ---------------------------------------------------------------- the page cache


def resident_fraction(files: Sequence[Path]) -> float | None:
    """Share of the files' pages in the page cache (mincore over a read-only mapping); None if unknown."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long)
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        page = os.sysconf("SC_PAGE_SIZE")
        total = resident = 0
        for f in files:
            size = f.stat().st_size
            if size == 0:
                continue
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            fd = os.open(f, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                try:
                    if libc.mincore(addr, size, vec) != 0:
                        return None
                finally:
                    libc.munmap(addr, size)
            finally:
                os.close(fd)
            total += pages
            resident += sum(v & 1 for v in vec)
        return resident / total if total else None
    except (OSError, AttributeError):
        return None


def drop_page_cache(files: Sequence[Path]) -> str:
    """Make the files cold: drop_caches when root may, else fadvise DONTNEED. Says which worked."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "dropped (drop_caches)"
    except OSError:
        pass
    ok = True
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            ok = False
    return "dropped (fadvise DONTNEED)" if ok else "unknown (fadvise failed)"


# ---------------------------------------------------------------- baselines, disk, digest


def measure_d2d(nbytes: int, device: torch.device) -> float:
    """Seconds for one device-to-device copy of nbytes (best of 3, after a warm-up)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return min(_seconds(lambda: dst.copy_(src)) for _ in range(3))


H2D_MAX_BYTES = 2 * GIB  # bandwidth is flat well below this; pinning more only costs start-up time


def measure_pinned_h2d(nbytes: int, device: torch.device) -> float:
    """Seconds for one pinned host-to-device copy of nbytes (best of 3, after a warm-up)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    return min(_seconds(lambda: dst.copy_(src, non_blocking=True)) for _ in range(3))


def checkpoint_specs(nbytes: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """The tensors of the synthetic Llama checkpoint of about nbytes (rfork.weights.synthetic's shapes)."""
    # imported here: they import torch, and `rfork bench --help` imports every benchmark (start-up time)
    from rfork.weights.synthetic import config_for_size

    return config_for_size(nbytes).tensor_specs()


def specs_bytes(specs: Sequence[tuple[str, str, tuple[int, ...]]]) -> int:
    import math

    return sum(math.prod(shape) * 2 for _name, _dtype, shape in specs)  # bf16


def write_checkpoint(directory: Path, specs: Sequence[tuple[str, str, tuple[int, ...]]], device: torch.device,
                     shard_bytes: int = 512 << 20) -> list[Path]:
    """safetensors shards of bf16 weights made on the GPU (random normal; seconds, not minutes, for 8 GiB)."""
    import math

    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, _dtype, shape in specs:
        nb = math.prod(shape) * 2
        if groups[-1] and used + nb > shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append((name, shape))
        used += nb
    files = []
    for k, group in enumerate(groups):
        shard = {}
        for i, (name, shape) in enumerate(group):
            t = torch.empty(shape, dtype=torch.bfloat16, device=device)
            fill_bf16(t.view(-1), 1000 * k + i)
            shard[name] = t.cpu()
        path = directory / f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        files.append(path)
    return files


def disk_rows(files: Sequence[Path], device: torch.device, nbytes: int) -> list[dict[str, Any]]:
    """safetensors into GPU memory, cache dropped then warm (`nbytes`: what the files hold)."""
    import torch
    from safetensors.torch import load_file

    rows = []
    for source in (report.DISK_COLD, report.DISK_WARM):
        state = drop_page_cache(files) if source == report.DISK_COLD else "warm"
        resident = resident_fraction(files)
        dt = _seconds(lambda: [load_file(str(f), device=str(device)) for f in files])
        torch.cuda.empty_cache()
        rows.append({"source": source, "kind": "disk", "seconds": dt, "bytes": nbytes,
                     "page_cache": state if resident is None else f"{state}, {resident:.0%} resident",
                     "resident_before": resident})
    return rows


def digest_row(nbytes: int, device: torch.device, check_bytes: int) -> dict[str, Any]:
    """The device digest's GB/s over nbytes of bf16 on the GPU (best of 3), and whether the CPU computes
    the same digest over the first check_bytes of them."""
    import torch

    # imported here: they import torch, and `rfork bench --help` imports every benchmark (start-up time)
    from rfork.weights import checksum as ck

    data = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    fill_bf16(data, 11)
    algorithm = ck.algorithm_for(device)
    ck.tensor_checksum(data[: 1 << 20])  # warm-up (index keys, kernels)
    best = min(_seconds(lambda: ck.tensor_checksum(data)) for _ in range(3))
    part = data.view(torch.uint8)[: min(check_bytes, nbytes)]
    on_gpu = ck.tensor_checksum(part)
    on_cpu = _host_digest(algorithm, part.cpu())
    return {"source": report.DEVICE_DIGEST, "kind": "digest", "seconds": best, "bytes": nbytes,
            "algorithm": algorithm, "verified": on_gpu == on_cpu, "cpu_check_bytes": min(check_bytes, nbytes),
            "gpu_digest": on_gpu, "cpu_digest": on_cpu, "page_cache": ""}


def _host_digest(algorithm: str, data: Any) -> str:
    """`algorithm` computed on the CPU over a flat uint8 host tensor (the GPU's algorithm, on the host)."""
    # imported here: they import torch, and `rfork bench --help` imports every benchmark (start-up time)
    from rfork.weights import checksum as ck

    if algorithm == ck.DEVICE_DIGEST:
        return ck.checksum_bytes(data)
    if algorithm == getattr(ck, "BLAKE3", None):
        return ck.blake3_bytes(data)
    return ck.xxh3_bytes(data)


# ---------------------------------------------------------------- the run


def machine_facts(device: torch.device, nbytes: int) -> dict[str, Any]:
    """What the figures were measured on."""
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu, memory = props.name, round(props.total_memory / GIB, 1)
    else:
        gpu, memory = "none: a CPU rehearsal, figures mean nothing", 0.0
    facts: dict[str, Any] = {
        "gpu": gpu, "gpu_memory_gib": memory, "torch": torch.__version__,
        "cuda": torch.version.cuda, "host": platform.node(), "cpus": os.cpu_count(), "bytes": nbytes,
        "load_average": os.getloadavg(), "processes": "two processes on one GPU (seed and loader)",
    }
    facts["driver"] = _smi_driver()
    try:
        from importlib import metadata

        facts["cuda_bindings"] = metadata.version("cuda-bindings")
    except Exception:  # noqa: BLE001
        facts["cuda_bindings"] = None
    try:
        # imported here: they import torch, and `rfork bench --help` imports every benchmark (start-up time)
        from backends.providers import _native

        facts["libfabric"] = f"{_native.VERSION[0]}.{_native.VERSION[1]}"
        facts["libfabric_library"] = _native.LIBRARY or "system"
    except Exception as exc:  # noqa: BLE001
        facts["libfabric"] = f"unavailable: {exc}"
    return facts


def _smi_driver() -> str | None:
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def run(args: argparse.Namespace) -> int:
    """Run every measurement, print the tables, optionally write JSON; 2 without CUDA, 1 if a path failed."""
    import torch

    if not torch.cuda.is_available() and not args.rehearse_on_cpu:
        print("error: bench.gpu needs a CUDA GPU (torch.cuda.is_available() is false here)", file=sys.stderr)
        return 2
    if args.size_gib <= 0:
        print(f"error: --size-gib must be positive, not {args.size_gib}", file=sys.stderr)
        return 2
    cpu = torch.device("cpu")
    device = cpu if args.rehearse_on_cpu else torch.device("cuda", torch.cuda.current_device())
    specs = checkpoint_specs(int(args.size_gib * GIB))
    nbytes = specs_bytes(specs)  # every row moves the same bytes: the checkpoint's
    facts = machine_facts(device, nbytes)
    rows: list[dict[str, Any]] = []
    errors: list[str] = []

    def save() -> None:  # after every step: a run cut short still leaves what it measured
        if args.json_file:
            report.write_json(args.json_file, facts, report.finish(rows, nbytes), report.goals(rows), errors)

    def attempt(what: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - one failed measurement must not lose the others
            errors.append(f"{what}: {type(exc).__name__}: {exc}")
            print(f"[bench gpu] {what} FAILED after {time.perf_counter() - t0:.1f} s: {exc}",
                  file=sys.stderr, flush=True)
            return None
        finally:
            torch.cuda.empty_cache()
        print(f"[bench gpu] {what}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        return out

    h2d_bytes = min(nbytes, H2D_MAX_BYTES)
    for source, fn, size in ((report.D2D, measure_d2d, nbytes),
                             (report.PINNED_H2D, measure_pinned_h2d, h2d_bytes)):
        dt = attempt(source, lambda fn=fn, size=size: fn(size, device))
        if dt is not None:
            rows.append({"source": source, "kind": "baseline", "seconds": dt, "bytes": size})
    save()
    if not {"ipc", "tcp", "shm"} <= set(args.skip):
        got = attempt("rfork pulls", lambda: rfork_rows(nbytes, device, args))
        if got is not None:
            rows += got[0]
            errors += got[1]
        save()
    check = int(args.digest_check_gib * GIB)
    digest = attempt("device digest", lambda: digest_row(nbytes, device, check))
    if digest is not None:
        rows.append(digest)
    save()
    if "disk" not in args.skip:
        tmp = None
        directory = Path(args.dir) if args.dir else Path(tmp := tempfile.mkdtemp(prefix="rfork-gpu-bench-"))
        try:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                files = attempt("write the checkpoint",
                                lambda: write_checkpoint(directory, specs, device)) or []
            if files:
                rows += attempt("disk->gpu", lambda: disk_rows(files, device, nbytes)) or []
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        save()
    report.finish(rows, nbytes)
    judged = report.goals(rows)
    report.print_tables(rows, judged, f"rfork GPU cold start: {nbytes / GIB:.2f} GiB on {facts['gpu']} "
                        f"(torch {facts['torch']}, CUDA {facts['cuda']}; two processes on one GPU)")
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    save()
    ok = not errors and all(r.get("verified", True) for r in rows)
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: parse argv and run."""
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
