"""RL weight update: one-sided writes on a static schedule against a gloo broadcast, same processes.

For each receiver count N, M trainer processes (TP=1 replicas; the schedule stripes every receiver's
bytes over them) and N receiver processes (TP=1) hold a Llama-shaped bf16 model of --size-gib.
Measured in the same processes and buffers:
- rfork: session setup (HELLO, schedule build) once, then updates: `RLTrainer.update` from the
  first post until every receiver confirmed it flipped to the new version (first and steady state);
- gloo: `torch.distributed.broadcast` of the same bytes from the trainers to all receivers (the
  two-sided way), between two barriers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing as mp
import os
import platform
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bench.processes import recv_within, stop_workers

SESSION = "bench-rl"


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork bench rl`."""
    parser.add_argument(
        "--receivers", type=int, nargs="+", default=[1, 2, 4], help="receiver counts to run (default 1 2 4)"
    )
    parser.add_argument("--size-gib", type=float, default=0.25, help="model size (default 0.25 GiB)")
    parser.add_argument("--trainers", type=int, default=1, help="trainer processes (default 1)")
    parser.add_argument("--repeat", type=int, default=3, help="updates/broadcasts per N after a first one")
    parser.add_argument(
        "--provider",
        "--providers",
        dest="providers",
        nargs="+",
        default=["tcp", "shm"],
        choices=["tcp", "shm"],
        help="one-sided providers to measure, each against its own gloo run (default tcp shm)",
    )
    parser.add_argument("--domains", type=int, default=1, help="engine domains per process (default 1)")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="weights in device memory (every process on GPU 0; cpu: the same code with CPU tensors), "
        "rfork staged through pinned host memory; gloo broadcasts the device tensors; adds a "
        "device-to-device copy bound",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")


def _specs(size_bytes: int) -> Any:  # noqa: ANN401
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from backends.rl import model_specs
    from rfork.weights.synthetic import config_for_size

    return model_specs(config_for_size(size_bytes).tensor_specs("bfloat16"))


def _worker(
    conn: Connection,
    role: str,
    index: int,
    size_bytes: int,
    provider: str,
    domains: int,
    store_port: int,
    device: str | None = None,
) -> None:
    """A trainer or receiver process: rfork session first, then the gloo group, driven by commands."""
    import torch
    import torch.distributed as dist

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from backends import TransferEngine
    from backends.rl import RLReceiver, RLTrainer, shard_layout
    from backends.rl.device import DeviceRLReceiver, DeviceRLTrainer
    from rfork.weights.memory import allocate

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(0)  # every process on the one GPU
    specs = _specs(size_bytes)
    layout = shard_layout(specs, tp_size=1, tp_rank=0)
    buffers = allocate(layout, device=device or "cpu")
    for b in buffers:
        b.fill_(0)  # pre-fault

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    eng = TransferEngine(provider, domains, timeout_s=30.0, host="127.0.0.1" if provider == "tcp" else None)
    conn.send(eng.address)
    roster, n_trainers, n_receivers = conn.recv()
    node: Any
    common: dict[str, Any] = {"session": SESSION, "specs": specs, "trainers": roster, "index": index}
    if role == "trainer" and device is None:
        node = RLTrainer(eng, buffers=buffers, timeout_s=300, **common)
    elif role == "trainer":
        node = DeviceRLTrainer(eng, device_buffers=buffers, timeout_s=300, **common)
    elif device is None:
        node = RLReceiver(eng, buffers=buffers, update_timeout_s=300, **common)
    else:
        node = DeviceRLReceiver(eng, device=device, buffers=buffers, update_timeout_s=300, **common)
    conn.send("ready")
    world = n_trainers + n_receivers
    rank = index if role == "trainer" else n_trainers + index
    gloo_bufs = [torch.zeros_like(b) for b in buffers] if role == "receiver" else buffers
    gloo_device = ["native" if device == "cuda" else "host tensors"]

    def broadcast(buf: torch.Tensor, src: int) -> None:
        if gloo_device[0] == "native":
            try:
                dist.broadcast(buf, src=src)
                return
            except RuntimeError as exc:
                logging.getLogger(__name__).warning("gloo broadcast refuses CUDA tensors (%s)", exc)
                gloo_device[0] = "host copies"
        if buf.device.type == "cuda":
            host = buf.cpu()
            dist.broadcast(host, src=src)
            buf.copy_(host)
        else:
            dist.broadcast(buf, src=src)

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "exit":
                break
            if cmd == "join":
                node.wait_receivers(args[0], 300)
                conn.send(node.schedule_seconds)
            elif cmd == "update":
                (version,) = args
                for b in buffers:
                    b.fill_(version & 0xFF)
                sync()
                start = time.time()
                res = node.update(version)
                conn.send({"seconds": res.seconds, "applied": len(res.applied), "bytes": res.bytes_posted,
                           "start": start})
            elif cmd == "device_wait":  # a device receiver: when its device slots flipped to the version
                (version,) = args
                ok = node.wait_version(version, 300)
                conn.send(node.applied_at if ok else None)
            elif cmd == "d2d":  # the bound: device-to-device copies of the bytes of n receivers' updates
                (n,) = args
                most = max(b.numel() for b in buffers)
                scratch = torch.empty(most, dtype=torch.uint8, device=buffers[0].device)
                sync()
                t0 = time.perf_counter()
                for _ in range(n):
                    for b in buffers:
                        scratch[: b.numel()].copy_(b)
                sync()
                conn.send(time.perf_counter() - t0)
                del scratch
            elif cmd == "check":
                (version,) = args
                with node.acquire() as snap:
                    ok = snap.version == version and all(
                        int(t.view(torch.uint8).min()) == int(t.view(torch.uint8).max()) == version & 0xFF
                        for t in snap.tensors.values()
                        if t.numel()
                    )
                conn.send(ok)
            elif cmd == "broadcast":
                dist.barrier()
                t0 = time.perf_counter()
                for buf in gloo_bufs:
                    n = buf.numel()
                    for j in range(n_trainers):
                        lo, hi = n * j // n_trainers, n * (j + 1) // n_trainers
                        broadcast(buf[lo:hi], src=j)
                sync()
                dist.barrier()
                conn.send((time.perf_counter() - t0, gloo_device[0]))
    finally:
        dist.destroy_process_group()
        node.close()
        eng.close()
        conn.close()
        os._exit(0)  # skip the interpreter's final collection (seconds with torch loaded)


def _measure(
    provider: str, n: int, args: argparse.Namespace, target_bytes: int, size_bytes: int
) -> dict[str, Any]:
    import torch.distributed as dist

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from backends.rl import TrainerRank

    ctx = mp.get_context("spawn")
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=300)
    )
    procs: list[tuple[Any, Connection]] = []
    roles = [("trainer", i) for i in range(args.trainers)] + [("receiver", j) for j in range(n)]
    try:
        for role, index in roles:
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(child, role, index, target_bytes, provider, args.domains, store.port, args.device),
                daemon=True,
            )
            p.start()
            child.close()
            procs.append((p, parent))
        addresses = [recv_within(c, 600) for _, c in procs]
        roster = [TrainerRank(addresses[i], 1, 0) for i in range(args.trainers)]
        t0 = time.perf_counter()
        for _, c in procs[: args.trainers]:
            c.send((roster, args.trainers, n))
        for _, c in procs[: args.trainers]:
            recv_within(c, 600)
        for _, c in procs[args.trainers :]:
            c.send((roster, args.trainers, n))
        for _, c in procs[args.trainers :]:
            recv_within(c, 600)
        trainers = [c for _, c in procs[: args.trainers]]
        for c in trainers:
            c.send(("join", n))
        schedule_s = max(recv_within(c, 600) for c in trainers)
        setup_s = time.perf_counter() - t0
        updates: list[float] = []
        receivers = [c for _, c in procs[args.trainers :]]
        for version in range(1, args.repeat + 2):
            for c in trainers:
                c.send(("update", version))
            replies = [recv_within(c, 600) for c in trainers]
            if any(r["applied"] != n for r in replies):
                raise RuntimeError(f"update {version} did not reach all {n} receivers: {replies}")
            if args.device is None:
                updates.append(max(r["seconds"] for r in replies))
                continue
            # on the device: from the first trainer's start (device -> pinned first) until the last
            # receiver's device slots flipped (same host: one wall clock)
            for c in receivers:
                c.send(("device_wait", version))
            flipped = [recv_within(c, 600) for c in receivers]
            if any(f is None for f in flipped):
                raise RuntimeError(f"update {version}: a receiver's device did not reach it")
            updates.append(max(flipped) - min(r["start"] for r in replies))
        for _, c in procs[args.trainers :]:
            c.send(("check", args.repeat + 1))
        verified = all(recv_within(c, 600) for _, c in procs[args.trainers :])
        gloo: list[float] = []
        gloo_how = ""
        for _ in range(args.repeat + 1):
            for _, c in procs:
                c.send(("broadcast",))
            answers = [recv_within(c, 600) for _, c in procs]
            gloo.append(max(a[0] for a in answers))
            gloo_how = answers[0][1]
        d2d: list[float] = []
        if args.device is not None:
            for _ in range(args.repeat + 1):
                trainers[0].send(("d2d", n))
                d2d.append(recv_within(trainers[0], 600))
    finally:
        stop_workers(procs)
    steady = statistics.median(updates[1:])
    base = statistics.median(gloo[1:])
    return {
        "provider": provider,
        "receivers": n,
        "trainers": args.trainers,
        "bytes_per_receiver": size_bytes,
        "setup_s": round(setup_s, 4),
        "schedule_build_s": round(schedule_s, 4),
        "first_update_s": round(updates[0], 4),
        "update_s": round(steady, 4),
        "update_runs_s": [round(u, 4) for u in updates[1:]],
        "gloo_broadcast_s": round(base, 4),
        "gloo_runs_s": [round(g, 4) for g in gloo[1:]],
        "update_gb_per_s": round(n * size_bytes / steady / 1e9, 3),
        "gloo_gb_per_s": round(n * size_bytes / base / 1e9, 3),
        "speedup_vs_gloo": round(base / steady, 3),
        "verified": verified,
    } | ({} if args.device is None else _device_row(n, size_bytes, steady, base, d2d, gloo_how))


def _device_row(
    n: int, size_bytes: int, steady: float, gloo: float, d2d: list[float], how: str
) -> dict[str, Any]:
    bound = statistics.median(d2d[1:])
    return {
        "d2d_s": round(bound, 4),
        "d2d_gb_per_s": round(n * size_bytes / bound / 1e9, 3),
        "x_of_d2d": round(steady / bound, 2),
        "gloo_on_device": how,
    }



def run(args: argparse.Namespace) -> int:
    """Run every receiver count, print the table, optionally write JSON."""
    if args.size_gib <= 0 or args.repeat < 1 or args.trainers < 1 or min(args.receivers) < 1:
        raise ValueError("--size-gib must be positive; --repeat, --trainers and --receivers at least 1")
    from rich.console import Console
    from rich.table import Table

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from backends.rl import shard_layout
    from bench.device_facts import machine_facts

    os.environ.setdefault("FI_TCP_IFACE", "lo")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("rfork bench rl --device cuda needs a CUDA GPU (torch sees none)")
    console = Console()
    target = int(args.size_gib * (1 << 30))
    size_bytes = shard_layout(_specs(target), tp_size=1, tp_rank=0).total_bytes
    rows = []
    for provider in args.providers:
        for n in args.receivers:
            with console.status(f"{provider}, {n} receiver(s)"):
                rows.append(_measure(provider, n, args, target, size_bytes))
    load = os.getloadavg()
    table = Table(
        title=f"RL weight update: {size_bytes / 1e9:.2f} GB per receiver, {args.trainers} trainer(s), "
        f"{args.domains} domain(s), median of {args.repeat}; load average {load[0]:.1f}"
        + ("" if args.device is None else f"; weights on {args.device}, rfork staged through pinned host")
    )
    cols = (
        "provider",
        "N",
        "setup s",
        "sched s",
        "first s",
        "update s",
        "GB/s",
        "gloo s",
        "gloo GB/s",
        "× gloo",
    ) + (() if args.device is None else ("d2d s", "× of d2d"))
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        extra = [] if args.device is None else [f"{r['d2d_s']:.3f}", f"{r['x_of_d2d']:.1f}"]
        table.add_row(
            r["provider"],
            str(r["receivers"]),
            f"{r['setup_s']:.2f}",
            f"{r['schedule_build_s']:.4f}",
            f"{r['first_update_s']:.3f}",
            f"{r['update_s']:.3f}",
            f"{r['update_gb_per_s']:.2f}",
            f"{r['gloo_broadcast_s']:.3f}",
            f"{r['gloo_gb_per_s']:.2f}",
            f"{r['speedup_vs_gloo']:.2f}" + ("" if r["verified"] else " UNVERIFIED"),
            *extra,
        )
    console.print(table)
    console.print(
        "update: first post until every receiver serves the new version; gloo: broadcast of the same "
        "bytes between barriers; × gloo = gloo s / update s (higher: rfork faster); "
        "sched: schedule build, once per session (not in update)"
        + ("" if args.device is None else "; on a device, update runs from the trainer's device->pinned "
           "copy until every receiver's device slots flipped; d2d: device copies of the same bytes")
    )
    goals = []
    if args.device is not None:
        for r in rows:
            gib = r["bytes_per_receiver"] / 2**30
            what = f"{r['provider']}: update of {gib:.2f} GiB to {r['receivers']} receiver(s)"
            speedup = r["speedup_vs_gloo"]
            goals.append({"goal": f"{what} >= 1.5x faster than gloo broadcast", "figure": speedup,
                          "unit": "x gloo", "met": speedup >= 1.5 and r["verified"]})
            goals.append({"goal": f"{what} within 3x of the d2d bound", "figure": r["x_of_d2d"],
                          "unit": "x of d2d", "met": r["x_of_d2d"] <= 3.0 and r["verified"]})
        for goal in goals:
            console.print(f"goal: {goal['goal']}: {goal['figure']} {goal['unit']} -> "
                          f"{'met' if goal['met'] else 'NOT met'}")
    doc = {
        "providers": args.providers,
        "trainers": args.trainers,
        "domains": args.domains,
        "repeat": args.repeat,
        "load_average": [round(x, 2) for x in load],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}
        | ({} if args.device is None else machine_facts(args.device)),
        "device": args.device,
        "rows": rows,
        "goals": goals,
    }
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    return 0
