"""RL weight deltas: an update after one optimizer step sends only the changed words; beside it, the
full update and a gloo broadcast of the same bytes, in the same processes.

One trainer and --receivers receiver processes (TP=1) hold a Llama-shaped bf16 model of --size-gib,
initialised N(0, 0.02). A step at learning rate lr is Adam's first step, w <- w - lr * sign(g) with a
random gradient g, rounded to bf16: at small lr most values do not change. Per lr, after two steps at
that lr (a receiver's free slot holds the version before the one it serves, so each delta carries two
steps' changes), --repeat updates are timed from the trainer's first post until every receiver serves
the version, its digest check included. The full update is an update after a step that changes every
value (the delta would not fit, so whole runs are sent), same session; gloo broadcasts the same bytes.
At the end every receiver's served bytes are compared with the trainer's by xxh3-128 ("verified").
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bench.processes import recv_within, stop_workers

SESSION = "bench-rl-delta"


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork bench rl-delta`."""
    parser.add_argument("--size-gib", type=float, default=0.25, help="model size (default 0.25 GiB)")
    parser.add_argument("--receivers", type=int, default=1, help="receiver processes (default 1)")
    parser.add_argument(
        "--lr", type=float, nargs="+", default=[5e-7, 1e-6, 1e-5, 1e-4],
        help="learning rates (default 5e-7 1e-6 1e-5 1e-4)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed updates per learning rate (default 3)")
    parser.add_argument(
        "--provider", default="tcp", choices=["tcp", "shm"], help="one-sided provider (default tcp)"
    )
    parser.add_argument(
        "--delta-fraction", type=float, default=0.25,
        help="each receiver's staging area, a fraction of its bytes: larger deltas go whole (default 0.25)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")


def _specs(size_bytes: int) -> Any:  # noqa: ANN401
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from backends.rl import model_specs
    from rfork.weights.synthetic import config_for_size

    return model_specs(config_for_size(size_bytes).tensor_specs("bfloat16"))


def _digest(buffers: Any) -> str:  # noqa: ANN401
    import xxhash

    h = xxhash.xxh3_128()
    for b in buffers:
        h.update(b.numpy().data)
    return h.hexdigest()


def _worker(
    conn: Connection, role: str, index: int, size_bytes: int, provider: str, store_port: int, fraction: float
) -> None:
    """The trainer or a receiver: the rfork session, then the gloo group, driven by commands."""
    import torch
    import torch.distributed as dist

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from backends import TransferEngine
    from backends.rl import RLReceiver, RLTrainer, shard_layout
    from rfork.weights.memory import allocate

    torch.set_num_threads(1)
    specs = _specs(size_bytes)
    layout = shard_layout(specs, tp_size=1, tp_rank=0)
    buffers = allocate(layout, device="cpu")
    for b in buffers:
        b.fill_(0)  # pre-fault
    eng = TransferEngine(provider, 1, timeout_s=30.0, host="127.0.0.1" if provider == "tcp" else None)
    conn.send(eng.address)
    roster, n_receivers = conn.recv()
    common: dict[str, Any] = {"session": SESSION, "specs": specs, "trainers": roster, "index": index}
    node: Any
    if role == "trainer":
        node = RLTrainer(eng, buffers=buffers, timeout_s=300, deltas=True, **common)
        gen = torch.Generator().manual_seed(0)
        for t in node.tensors.values():
            t.copy_((torch.randn(t.shape, generator=gen) * 0.02).to(t.dtype))
    else:
        node = RLReceiver(eng, buffers=buffers, update_timeout_s=300, delta_fraction=fraction, **common)
    conn.send("ready")
    gloo_bufs = buffers if role == "trainer" else [torch.zeros_like(b) for b in buffers]
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group(
        "gloo", store=store, rank=0 if role == "trainer" else 1 + index, world_size=1 + n_receivers
    )
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "exit":
                break
            if cmd == "join":
                node.wait_receivers(args[0], 300)
                conn.send(True)
            elif cmd == "step":  # one optimizer step at lr (None: every value changes), then the update
                version, lr = args
                changed = total = 0
                for t in node.tensors.values():
                    old = t.clone()
                    if lr is None:
                        t.copy_((torch.randn(t.shape) * 0.02).to(t.dtype))
                    else:
                        t.copy_((t.float() - lr * torch.randn(t.shape).sign()).to(t.dtype))
                    changed += int((t != old).sum())
                    total += t.numel()
                res = node.update(version)
                conn.send({"seconds": res.seconds, "applied": len(res.applied), "bytes": res.bytes_posted,
                           "delta": len(res.as_delta), "changed": changed / total})
            elif cmd == "digest":
                if role == "trainer":
                    conn.send(_digest(node.buffers))
                else:
                    with node.acquire() as snap:
                        conn.send((snap.version, _digest(node._slots[snap.slot])))
            elif cmd == "broadcast":
                dist.barrier()
                t0 = time.perf_counter()
                for buf in gloo_bufs:
                    dist.broadcast(buf, src=0)
                dist.barrier()
                conn.send(time.perf_counter() - t0)
    finally:
        dist.destroy_process_group()
        node.close()
        eng.close()
        conn.close()
        os._exit(0)  # skip the interpreter's final collection (seconds with torch loaded)



def _measure(args: argparse.Namespace, target: int, size_bytes: int) -> dict[str, Any]:
    import torch.distributed as dist

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from backends.rl import TrainerRank

    ctx = mp.get_context("spawn")
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=300)
    )
    procs: list[tuple[Any, Connection]] = []
    roles = [("trainer", 0)] + [("receiver", j) for j in range(args.receivers)]
    try:
        for role, index in roles:
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(child, role, index, target, args.provider, store.port, args.delta_fraction),
                daemon=True,
            )
            p.start()
            child.close()
            procs.append((p, parent))
        addresses = [recv_within(c, 600) for _, c in procs]
        roster = [TrainerRank(addresses[0], 1, 0)]
        for _, c in procs:  # the trainer first: receivers say HELLO to it when they start
            c.send((roster, args.receivers))
            recv_within(c, 600)
        trainer = procs[0][1]
        trainer.send(("join", args.receivers))
        recv_within(trainer, 600)
        version = 0

        def step(lr: float | None) -> dict[str, Any]:
            nonlocal version
            version += 1
            trainer.send(("step", version, lr))
            got = recv_within(trainer, 600)
            if got["applied"] != args.receivers:
                raise RuntimeError(f"update {version} did not reach all {args.receivers} receivers: {got}")
            return dict(got)

        full = [step(None) for _ in range(2 + args.repeat)][2:]
        rows = []
        for lr in args.lr:
            step(lr)
            step(lr)
            runs = [step(lr) for _ in range(args.repeat)]
            rows.append({
                "lr": lr,
                "changed_per_step": statistics.median(r["changed"] for r in runs),
                "update_s": statistics.median(r["seconds"] for r in runs),
                "update_runs_s": [round(r["seconds"], 4) for r in runs],
                "bytes": statistics.median(r["bytes"] for r in runs),
                "as_delta": all(r["delta"] == args.receivers for r in runs),
            })
        trainer.send(("digest",))
        want = recv_within(trainer, 600)
        served = []
        for _, c in procs[1:]:
            c.send(("digest",))
            served.append(recv_within(c, 600))
        verified = all(v == version and d == want for v, d in served)
        gloo = []
        for _ in range(args.repeat):
            for _, c in procs:
                c.send(("broadcast",))
            gloo.append(max(recv_within(c, 600) for _, c in procs))
    finally:
        stop_workers(procs)
    full_s = statistics.median(r["seconds"] for r in full)
    gloo_s = statistics.median(gloo)
    for row in rows:
        row["x_full"] = round(full_s / row["update_s"], 2)
        row["x_gloo"] = round(gloo_s / row["update_s"], 2)
        row["bytes_of_full"] = round(row["bytes"] / (size_bytes * args.receivers), 4)
    return {
        "full_update_s": round(full_s, 4),
        "full_runs_s": [round(r["seconds"], 4) for r in full],
        "gloo_broadcast_s": round(gloo_s, 4),
        "rows": rows,
        "verified": verified,
    }


def run(args: argparse.Namespace) -> int:
    """Measure, print the table, optionally write JSON."""
    if args.size_gib <= 0 or args.repeat < 1 or args.receivers < 1 or not 0 < args.delta_fraction <= 1:
        raise ValueError("--size-gib positive; --repeat, --receivers at least 1; --delta-fraction in (0, 1]")
    from rich.console import Console
    from rich.table import Table

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from backends.rl import shard_layout

    os.environ.setdefault("FI_TCP_IFACE", "lo")
    console = Console()
    target = int(args.size_gib * (1 << 30))
    size_bytes = shard_layout(_specs(target), tp_size=1, tp_rank=0).total_bytes
    with console.status(f"{args.provider}, {args.receivers} receiver(s)"):
        got = _measure(args, target, size_bytes)
    load = os.getloadavg()
    table = Table(
        title=f"RL weight deltas: {size_bytes / 1e9:.2f} GB bf16 per receiver, {args.receivers} receiver(s), "
        f"{args.provider}, median of {args.repeat}; full update {got['full_update_s']:.3f} s, gloo broadcast "
        f"{got['gloo_broadcast_s']:.3f} s; load average {load[0]:.1f}"
    )
    cols = ("lr", "values changed / step", "sent as", "bytes sent", "of full", "update s", "× full", "× gloo")
    for col in cols:
        table.add_column(col, justify="right")
    for r in got["rows"]:
        table.add_row(
            f"{r['lr']:g}",
            f"{100 * r['changed_per_step']:.2f} %",
            "delta" if r["as_delta"] else "whole runs",
            f"{r['bytes'] / 1e6:.1f} MB",
            f"{100 * r['bytes_of_full']:.1f} %",
            f"{r['update_s']:.3f}",
            f"{r['x_full']:.2f}",
            f"{r['x_gloo']:.2f}",
        )
    console.print(table)
    console.print(
        "update: the trainer's first post until every receiver serves the version (its digest check "
        "included); a delta carries two steps' changes (the free slot holds the version before the "
        "served one); "
        f"× full = full update s / update s; verified: {'yes' if got['verified'] else 'NO'}"
    )
    if args.json:
        doc = {
            "size_bytes": size_bytes,
            "receivers": args.receivers,
            "provider": args.provider,
            "repeat": args.repeat,
            "delta_fraction": args.delta_fraction,
            "load_average": [round(x, 2) for x in load],
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        } | got
        args.json.write_text(json.dumps(doc, indent=1))
    return 0 if got["verified"] else 1
