"""`rfork bench gpu`'s two processes on one GPU: a seed holding bf16 weights in GPU memory, and this
process pulling them by CUDA IPC (each backend) and through pinned bounce slots over tcp and shm.

The seed fills its weights on the GPU, takes their device digest there, exports them over CUDA IPC
(driver and torch exports) and serves one pinned host mirror over tcp and over shm (those providers
cannot register device memory). It lives until this process says it is done: a CUDA IPC mapping of
freed memory would be undefined. Every pull is verified: the loader's device digest of what landed
against the seed's. One GPU: "GPU to GPU" here is two processes on the same device.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger(__name__)
SEED_UP_S = 90.0  # starting CUDA, filling, digesting and mirroring 8 GiB takes seconds; a hung start fails


def _sync_seconds(fn: Any) -> float:
    """Wall seconds of fn with the GPU idle before and after (no GPU: plain wall seconds, for rehearsals)."""
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def fill_bf16(t: Any, seed: int) -> None:
    """Normal-ish bf16 values on the GPU in 256 MiB slices (no host round trip)."""
    import torch

    g = torch.Generator(device=t.device).manual_seed(seed)
    step = 128 << 20  # elements
    for k in range(0, t.numel(), step):
        n = min(step, t.numel() - k)
        t[k:k + n] = torch.randn(n, dtype=torch.float32, device=t.device, generator=g).to(torch.bfloat16)


def _seed_main(conn: Connection, nbytes: int, device_name: str, staged: list[str], domains: int) -> None:
    """Seed process: bf16 weights in GPU memory; descriptors and the device digest go to the parent.
    (On "cpu", the bench's CPU rehearsal: host weights, no CUDA IPC, the staged paths as they are.)"""
    import torch

    # imported here: they import torch, and `rfork bench --help` imports every benchmark (start-up time)
    from backends.gpu import driver
    from backends.gpu.cuda_ipc import CudaIpcEngine
    from backends.gpu.staging import host_mirror
    from rfork.weights import checksum as ck

    os.environ.setdefault("FI_TCP_IFACE", "lo")
    dev = torch.device(device_name)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    weights = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    fill_bf16(weights, 7)
    if cuda:
        torch.cuda.synchronize()
    info: dict[str, Any] = {"digest": ck.tensor_checksum(weights), "algorithm": ck.algorithm_for(dev),
                            "ipc": {}, "staged": {}, "errors": []}
    engines: list[Any] = []
    for kind in ((["driver"] if driver.available() else []) + ["torch"]) if cuda else []:
        try:
            ipc = CudaIpcEngine(dev, backend=kind)
            engines.append(ipc)
            info["ipc"][kind] = ipc.register(weights, "read").descriptor.to_bytes()
        except Exception as exc:  # noqa: BLE001 - a failed path is a row's error, not the run's end
            info["errors"].append(f"seed cuda-ipc ({kind}) export: {type(exc).__name__}: {exc}")
    mirror = None
    if staged:
        from backends import TransferEngine

        t0 = time.perf_counter()
        mirror = host_mirror(weights)
        info["mirror_seconds"] = time.perf_counter() - t0
        for provider in staged:
            try:
                eng = TransferEngine(provider, domains, host="127.0.0.1" if provider == "tcp" else None,
                                     timeout_s=30.0)
                engines.append(eng)
                info["staged"][provider] = eng.register(mirror, "read").descriptor.to_bytes()
            except Exception as exc:  # noqa: BLE001
                info["errors"].append(f"seed {provider} register: {type(exc).__name__}: {exc}")
    conn.send(info)
    conn.recv()  # the loader is done: only now may the memory go
    for eng in engines:
        eng.close()
    del mirror


def rfork_rows(nbytes: int, device: Any, args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per path (verified against the seed's device digest), and the errors of those that failed."""
    import torch

    staged = [p for p in ("tcp", "shm") if p not in args.skip]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_seed_main, args=(child, nbytes, str(device), staged, args.domains),
                       daemon=True)
    proc.start()
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    try:
        if not parent.poll(SEED_UP_S):
            raise RuntimeError(f"the seed process did not come up within {SEED_UP_S:.0f} s")
        info = parent.recv()
        errors += info["errors"]
        want = info["digest"]
        dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
        for kind, desc in info["ipc"].items():
            try:
                rows.append(_ipc_row(kind, desc, dst, want))
            except Exception as exc:  # noqa: BLE001 - the other paths still run
                errors.append(f"rfork cuda-ipc ({kind}): {type(exc).__name__}: {exc}")
            dst.zero_()
        for provider, desc in info["staged"].items():
            try:
                rows.append(staged_row(provider, desc, dst, want, args))
            except Exception as exc:  # noqa: BLE001
                errors.append(f"rfork {provider}+staging: {type(exc).__name__}: {exc}")
            dst.zero_()
        if "mirror_seconds" in info:
            log.info("the seed's pinned host mirror took %.2f s", info["mirror_seconds"])
        parent.send("done")
        proc.join(60)
        del dst
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    return rows, errors


def _ipc_row(kind: str, desc: bytes, dst: Any, want: str) -> dict[str, Any]:
    # imported here: they import torch, and `rfork bench --help` imports every benchmark (start-up time)
    from backends.gpu.cuda_ipc import CudaIpcEngine
    from rfork.weights import checksum as ck

    nbytes = dst.numel() * dst.element_size()
    with CudaIpcEngine(dst.device, backend=kind) as eng:
        reg = eng.register(dst, "write")
        t_open = _sync_seconds(lambda: eng.read(reg, 0, 4096, desc, 0).result(60))
        best = min(_sync_seconds(lambda: eng.read(reg, 0, nbytes, desc, 0).result(120)) for _ in range(3))
    return {"source": f"rfork cuda-ipc ({kind})", "kind": "rfork", "seconds": best, "open_seconds": t_open,
            "verified": ck.tensor_checksum(dst) == want, "note": "best of 3, after the first open"}


def staged_row(provider: str, desc: bytes, dst: Any, want: str, args: argparse.Namespace) -> dict[str, Any]:
    # imported here: they import torch, and `rfork bench --help` imports every benchmark (start-up time)
    from backends import TransferEngine
    from backends.gpu.staging import StagedReader
    from rfork.weights import checksum as ck

    nbytes = dst.numel() * dst.element_size()
    host = "127.0.0.1" if provider == "tcp" else None
    with (
        TransferEngine(provider, args.domains, host=host, timeout_s=30.0) as eng,
        StagedReader(eng, bounce_bytes=args.bounce_mib << 20, depth=args.depth, device=dst.device) as rd,
    ):
        rd.read_into(dst, 0, 4096, desc, 0).result(60)  # connect
        seconds = _sync_seconds(lambda: rd.read_into(dst, 0, nbytes, desc, 0).result(600))
    return {"source": f"rfork {provider}+staging", "kind": "rfork", "seconds": seconds,
            "verified": ck.tensor_checksum(dst) == want,
            "note": f"{args.bounce_mib} MiB x {args.depth} pinned slots, {args.domains} domains"}
