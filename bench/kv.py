"""KV-cache transfer benchmark: requests/s and GB/s of paged KV requests against contiguous writes.

A prefill side (this process) holds a paged pool; a decode side (spawned process) joins it as a
KvReceiver. Per prompt length, each request moves every layer's K and V pages (scattered page ids
on both sides, as in a busy server) and completes on the receiver's ImmCounter. The baseline, in
the same run against the same peer, writes the same number of bytes as one contiguous op.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger(__name__)

MiB = 1 << 20


def configure(parser: argparse.ArgumentParser) -> None:
    """Options: provider, geometry, prompt lengths, JSON output."""
    parser.add_argument("--provider", choices=["tcp", "shm"], default="tcp")
    parser.add_argument("--layers", type=int, default=32, help="transformer layers (default 32)")
    parser.add_argument("--page-tokens", type=int, default=16, help="tokens per page (default 16)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128; bf16)")
    parser.add_argument(
        "--prompts",
        type=_int_list,
        default=[256, 1024, 2048],
        help="prompt lengths in tokens (default 256,1024,2048)",
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="rough time per measurement")
    parser.add_argument("--domains", type=int, default=1, help="domains (parallel endpoints) per engine")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="pools in device memory, staged through pinned host memory (cpu: the same code with CPU "
        "tensors standing in for the device); default: host pools, no staging",
    )
    parser.add_argument("--json", dest="json_file", default=None, help="write the rows to this JSON file")


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from exc
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError("prompt lengths must be positive")
    return out


def _decode_main(
    conn: Connection,
    provider: str,
    domains: int,
    geometry: dict[str, int],
    contiguous: int,
    device: str | None = None,
) -> None:
    """Receiver process: a pool and a contiguous region; answers ("want", sender, rid, pages) when landed.

    With a device: the pool is device memory behind a pinned mirror (every layer is on the device
    before "done"), and ("flat", n) copies the contiguous region's first n bytes to the device.
    """
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    import numpy as np
    import torch

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from backends import TransferEngine, TransferError
    from backends.gpu.host_copy import copy_now, pinned_empty
    from backends.kv import KvPool, KvReceiver
    from backends.kv.device import DeviceKvPool, DeviceKvReceiver

    kw: dict[str, Any] = {"host": "127.0.0.1"} if provider == "tcp" else {}
    with TransferEngine(provider, domains, timeout_s=30.0, **kw) as eng:
        layers, pages, page_bytes = geometry["layers"], geometry["pages"], geometry["page_bytes"]
        receiver: Any
        dev_flat = None
        if device is None:
            pool = KvPool(eng, layers=layers, pages=pages, page_bytes=page_bytes)
            pool.buffer.fill(0)  # fault the pages in: timed writes should not pay for that
            flat: Any = np.zeros(contiguous, dtype=np.uint8)
            receiver = KvReceiver(pool, name="bench-decode", timeout_s=60.0)
        else:
            dev = torch.zeros(layers * 2 * pages * page_bytes, dtype=torch.uint8, device=device)
            dpool = DeviceKvPool(eng, layers=layers, pages=pages, page_bytes=page_bytes, device_buffer=dev)
            dpool.mirror.fill_(0)
            flat = pinned_empty(contiguous).fill_(0)
            dev_flat = torch.zeros(contiguous, dtype=torch.uint8, device=device)
            receiver = DeviceKvReceiver(dpool, name="bench-decode", timeout_s=60.0)
        flat_region = eng.register(flat, "write")
        conn.send((eng.address, flat_region.descriptor.to_bytes()))
        while True:
            msg = conn.recv()
            if msg[0] == "exit":
                break
            if msg[0] == "join":
                receiver.join(msg[1])
                conn.send("joined")
                continue
            if msg[0] == "flat":  # the contiguous baseline landed in the mirror: on to the device
                if dev_flat is not None:
                    copy_now(dev_flat[: msg[1]], flat[: msg[1]])
                conn.send("done")
                continue
            _, sender, rid, pages = msg
            try:
                req = receiver.request(sender, rid, pages)
                conn.send("requested")
                req.wait(60)
                conn.send("done")
            except TransferError as exc:
                conn.send(f"error: {exc}")


def run(args: argparse.Namespace) -> int:
    """Measure each prompt length, print a table, optionally write JSON."""
    import numpy as np

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    import torch
    from rich.console import Console
    from rich.table import Table

    from backends import MemoryRegionDescriptor, TransferEngine
    from backends.gpu.host_copy import copy_now, pinned_empty
    from backends.kv import KvPool, KvSender
    from backends.kv.device import DeviceKvPool, DeviceKvSender
    from bench.device_facts import machine_facts

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("rfork bench kv --device cuda needs a CUDA GPU (torch sees none)")
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    page_bytes = args.page_tokens * args.kv_heads * args.head_dim * 2
    max_pages = -(-max(args.prompts) // args.page_tokens)
    pool_pages = 2 * max_pages
    geometry = {"layers": args.layers, "pages": pool_pages, "page_bytes": page_bytes}
    max_request = args.layers * 2 * max_pages * page_bytes
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    peer = ctx.Process(
        target=_decode_main,
        args=(child, args.provider, args.domains, geometry, max_request, device),
        daemon=True,
    )
    peer.start()
    rows: list[dict[str, Any]] = []
    kw: dict[str, Any] = {"host": "127.0.0.1"} if args.provider == "tcp" else {}

    def call(msg: tuple[Any, ...], timeout: float = 120.0) -> Any:
        parent.send(msg)
        if not parent.poll(timeout):
            raise RuntimeError(f"decode process did not answer {msg[0]!r} within {timeout:g}s")
        answer = parent.recv()
        if isinstance(answer, str) and answer.startswith("error"):
            raise RuntimeError(answer)
        return answer

    try:
        if not parent.poll(120):
            raise RuntimeError("decode process did not start")
        _addr, flat_b = parent.recv()
        flat_desc = MemoryRegionDescriptor.from_bytes(flat_b)
        with TransferEngine(args.provider, args.domains, timeout_s=30.0, **kw) as eng:
            sender: Any
            dev_flat = None
            if device is None:
                pool = KvPool(eng, layers=args.layers, pages=pool_pages, page_bytes=page_bytes)
                pool.buffer[:] = np.random.default_rng(0).integers(0, 256, pool.buffer.size, dtype=np.uint8)
                flat: Any = np.ones(max_request, dtype=np.uint8)
                sender = KvSender(pool)
            else:
                g = torch.Generator().manual_seed(0)
                nbytes_pool = args.layers * 2 * pool_pages * page_bytes
                dev = torch.randint(0, 256, (nbytes_pool,), dtype=torch.uint8, generator=g).to(device)
                dpool = DeviceKvPool(
                    eng, layers=args.layers, pages=pool_pages, page_bytes=page_bytes, device_buffer=dev
                )
                flat = pinned_empty(max_request).fill_(1)
                dev_flat = torch.ones(max_request, dtype=torch.uint8, device=device)
                sender = DeviceKvSender(dpool)
            flat_region = eng.register(flat, "read")
            call(("join", sender.address))
            rng = np.random.default_rng(1)
            seq = 0
            for tokens in args.prompts:
                npages = -(-tokens // args.page_tokens)
                nbytes = args.layers * 2 * npages * page_bytes
                reps = int(max(3, min(200, args.seconds * 1e9 / max(nbytes, 1))))

                # the scattered page ids, drawn before the clock starts (the baseline draws nothing)
                plans = [
                    (rng.choice(pool_pages, npages, replace=False).tolist(),
                     rng.choice(pool_pages, npages, replace=False).tolist())
                    for _ in range(reps + 1)
                ]

                def kv_request(plans: list[tuple[list[int], list[int]]] = plans) -> None:
                    nonlocal seq
                    seq += 1
                    src, dst = plans.pop()
                    rid = f"bench-{seq}"
                    parent.send(("want", sender.address, rid, dst))
                    out = sender.start(rid, src).send_all()
                    out.wait(60)
                    for expected in ("requested", "done"):
                        if not parent.poll(60) or parent.recv() != expected:
                            raise RuntimeError(f"decode process did not report {expected} for {rid}")

                def contiguous(nbytes: int = nbytes) -> None:
                    if dev_flat is None:
                        eng.write(flat_region, 0, nbytes, flat_desc, 0).result(60)
                        return
                    # the same path as the pages: device -> pinned, one write, pinned -> device there
                    copy_now(flat[:nbytes], dev_flat[:nbytes])
                    eng.write(flat_region, 0, nbytes, flat_desc, 0).result(60)
                    call(("flat", nbytes))

                kv_request()  # warm-up (and connect)
                contiguous()
                t0 = time.perf_counter()
                for _ in range(reps):
                    kv_request()
                kv_s = (time.perf_counter() - t0) / reps
                t0 = time.perf_counter()
                for _ in range(reps):
                    contiguous()
                flat_s = (time.perf_counter() - t0) / reps
                kv_gbps, flat_gbps = nbytes / kv_s / 1e9, nbytes / flat_s / 1e9
                rows.append(
                    {
                        "prompt_tokens": tokens,
                        "pages_per_layer": npages,
                        "request_bytes": nbytes,
                        "requests": reps,
                        "requests_per_s": round(1 / kv_s, 2),
                        "kv_gb_per_s": round(kv_gbps, 3),
                        "contiguous_gb_per_s": round(flat_gbps, 3),
                        "ratio": round(kv_gbps / flat_gbps, 3) if flat_gbps else 0.0,
                    }
                )
                log.info("KV %d tokens: %.3f GB/s vs contiguous %.3f GB/s", tokens, kv_gbps, flat_gbps)
    finally:
        if peer.is_alive():
            parent.send(("exit",))
            peer.join(10)
        if peer.is_alive():
            peer.kill()
    where = "host pools" if device is None else f"{device} pools staged through pinned host memory"
    table = Table(
        title=(
            f"rfork KV transfer ({where}), provider={args.provider}, {args.layers} layers, "
            f"{args.page_tokens}-token pages ({page_bytes // 1024} KiB), scattered page ids; "
            "baseline: one contiguous write of the same bytes"
        )
    )
    for col in ("prompt tokens", "MiB/request", "requests/s", "KV GB/s", "contiguous GB/s", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["prompt_tokens"]),
            f"{r['request_bytes'] / MiB:.1f}",
            f"{r['requests_per_s']:.1f}",
            f"{r['kv_gb_per_s']:.2f}",
            f"{r['contiguous_gb_per_s']:.2f}",
            f"{r['ratio']:.2f}",
        )
    console = Console()
    console.print(table)
    goals = []
    if device is not None:
        worst = min((r["ratio"] for r in rows), default=0.0)
        goals.append({
            "goal": f"{page_bytes // 1024} KiB-page batches {device} to {device} >= 0.5x of a contiguous "
            "transfer of the same bytes by the same path",
            "figure": worst,
            "unit": "x (worst prompt length)",
            "met": worst >= 0.5,
        })
        for goal in goals:
            console.print(f"goal: {goal['goal']}: {goal['figure']} {goal['unit']} -> "
                          f"{'met' if goal['met'] else 'NOT met'}")
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(
                {
                    "provider": args.provider,
                    "device": device,
                    "geometry": geometry,
                    "domains": args.domains,
                    "machine": machine_facts(device),
                    "rows": rows,
                    "goals": goals,
                },
                f,
                indent=1,
            )
    return 0

