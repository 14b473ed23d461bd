"""MoE benchmark: expert-parallel dispatch/combine latency over rfork vs gloo all_to_all_single.

Spawns --ranks processes. Every iteration, each rank routes its --tokens tokens (uniform top-k over
--experts experts) and runs the same round twice, in alternating order: once over backends.moe
(one engine per provider) and once as the torch.distributed baseline on gloo (token counts first,
then tokens, expert ids and expert outputs with all_to_all_single). Both sides use the same routing
plan and the same fp32 reduction, and their outputs are compared for equality. Dispatch is timed
from the send call to the planned receive; combine from the send call to the reduced output.
Latency per iteration = the slowest rank's; p50/p99 over iterations, in microseconds.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any, cast

log = logging.getLogger(__name__)

PHASES = ("dispatch", "combine")
# CPU work both sides do, timed inside the gloo run: routing plan (dispatch), fp32 reduction (combine).
SHARED = "shared"
D2D = "d2d"  # with --device: the device-to-device copy bound


def configure(parser: argparse.ArgumentParser) -> None:
    """Options: ranks, tokens, hidden, topk, experts, providers, wire, iterations, JSON output."""
    parser.add_argument("--ranks", type=int, default=4, help="expert-parallel ranks (processes)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=7168, help="hidden size (bf16 activations)")
    parser.add_argument("--topk", type=int, default=8, help="experts per token")
    parser.add_argument("--experts", type=int, default=256, help="experts in total, spread evenly over ranks")
    parser.add_argument(
        "--provider", default="shm", help="comma-separated rfork providers to time: shm, tcp (default shm)"
    )
    parser.add_argument("--wire", choices=["bf16", "fp8"], default="bf16", help="dispatch wire format")
    parser.add_argument("--iters", type=int, default=50, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="tokens and expert outputs in device memory (all ranks on GPU 0; cpu: the same code with CPU "
        "tensors), rfork staged through pinned host memory; adds a device-to-device copy bound",
    )
    parser.add_argument("--json", dest="json_file", default=None, help="write the results to this JSON file")


def _check(args: argparse.Namespace) -> list[str]:
    providers = [p.strip() for p in str(args.provider).split(",") if p.strip()]
    bad = [p for p in providers if p not in ("shm", "tcp")]
    if not providers or bad:
        raise ValueError(f"--provider must list shm and/or tcp, not {args.provider!r}")
    if args.ranks < 2:
        raise ValueError(f"--ranks must be >= 2, not {args.ranks}")
    if args.tokens < 1 or args.hidden < 1 or args.iters < 1 or args.warmup < 0:
        raise ValueError("--tokens, --hidden and --iters must be >= 1, --warmup >= 0")
    if not 1 <= args.topk <= args.experts:
        raise ValueError(f"--topk must be between 1 and --experts ({args.experts}), not {args.topk}")
    return providers


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of a non-empty sorted list."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def _rank_main(
    conn: Connection, rank: int, args: dict[str, Any], providers: list[str], store_port: int
) -> None:
    """One rank: gloo group + one ExpertParallel per provider; time every iteration; report to the parent."""
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    import torch
    import torch.distributed as dist

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from backends import TransferEngine
    from backends.moe import ExpertParallel
    from backends.moe.device import DeviceExpertParallel
    from backends.moe.routing import combine_reduce, plan_dispatch, plan_receive

    torch.set_num_threads(1)
    device = args.get("device")
    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    world, tokens, hidden, topk, experts = (
        args["ranks"],
        args["tokens"],
        args["hidden"],
        args["topk"],
        args["experts"],
    )
    try:
        store = dist.TCPStore("127.0.0.1", store_port, None, False, _td(120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=_td(120))
        engines, groups = [], []
        for provider in providers:
            kw: dict[str, Any] = {"host": "127.0.0.1"} if provider == "tcp" else {}
            eng = TransferEngine(provider, 1, timeout_s=30.0, chunk_bytes=64 << 20, **kw)
            ep = (ExpertParallel if device is None else functools.partial(DeviceExpertParallel, device=dev))(
                eng,
                rank=rank,
                world_size=world,
                num_experts=experts,
                hidden=hidden,
                topk=topk,
                max_tokens=tokens,
                wire=args["wire"],
                timeout_s=60.0,
            )
            blobs: list[Any] = [None] * world
            dist.all_gather_object(blobs, ep.setup_blob())
            ep.connect(blobs)
            engines.append(eng)
            groups.append(ep)
        to_rank, to_local = groups[0].expert_to_rank, groups[0].expert_to_local
        g = torch.Generator().manual_seed(1234 + rank)
        variants = []
        for _ in range(4):  # a few routings, cycled, so no iteration replays the previous one's exactly
            x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
            ids = torch.rand(tokens, experts, generator=g).topk(topk, dim=1).indices
            w = torch.softmax(torch.randn(tokens, topk, generator=g), dim=1)
            variants.append((x.to(dev), ids, w.to(dev)))  # routing ids stay host data (the plan is host work)

        def run_rfork(ep: ExpertParallel, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Any:
            dist.barrier()
            t0 = time.perf_counter()
            ep.dispatch_send(x, ids)
            d = ep.dispatch_recv()
            t1 = time.perf_counter()
            if d.scales is None:  # identity experts: each pair's output is its input row
                torch.index_select(d.x, 0, d.pair_row, out=d.out)
            else:
                d.out.copy_(d.gather(torch.arange(d.pair_row.numel(), device=d.pair_row.device)))
            sync()
            dist.barrier()
            t2 = time.perf_counter()
            ep.combine_send(d)
            y = ep.combine_recv(w)
            t3 = time.perf_counter()
            return t1 - t0, t3 - t2, y

        # The baseline gets the same courtesy as rfork: buffers allocated once, not per iteration.
        g_send_x = torch.empty(world * tokens, hidden, dtype=torch.bfloat16, device=dev)
        g_recv_x = torch.empty(world * tokens, hidden, dtype=torch.bfloat16, device=dev)
        g_recv_ids = torch.empty(world * tokens, topk, dtype=torch.int32)
        g_out = torch.empty(world * tokens * topk, hidden, dtype=torch.bfloat16, device=dev)
        g_back = torch.empty(tokens * topk, hidden, dtype=torch.bfloat16, device=dev)
        gloo_cuda = ["native"]  # or "host copies" if this gloo refuses CUDA tensors in all_to_all_single

        def a2a(out: torch.Tensor, inp: torch.Tensor, sizes_out: Any = None, sizes_in: Any = None) -> None:
            if out.device.type == "cuda" and gloo_cuda[0] == "native":
                try:
                    dist.all_to_all_single(out, inp, sizes_out, sizes_in)
                    return
                except RuntimeError as exc:
                    log.warning("gloo all_to_all_single refuses CUDA tensors (%s): host copies instead", exc)
                    gloo_cuda[0] = "host copies"
            if out.device.type == "cuda":
                host_out = torch.empty(out.shape, dtype=out.dtype)
                dist.all_to_all_single(host_out, inp.cpu(), sizes_out, sizes_in)
                out.copy_(host_out)
            else:
                dist.all_to_all_single(out, inp, sizes_out, sizes_in)

        def run_gloo(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Any:
            dist.barrier()
            t0 = time.perf_counter()
            plan = plan_dispatch(ids, to_rank, world)
            t_plan = time.perf_counter() - t0
            send_counts = torch.tensor([int(t.numel()) for t in plan.dest_tokens], dtype=torch.int64)
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts)
            sizes_in, sizes_out = send_counts.tolist(), recv_counts.tolist()
            n_in, n_out = sum(sizes_in), sum(sizes_out)
            send_x = torch.index_select(x, 0, torch.cat(plan.dest_tokens).to(dev), out=g_send_x[:n_in])
            recv_x = g_recv_x[:n_out]
            a2a(recv_x, send_x, sizes_out, sizes_in)
            recv_ids = g_recv_ids[:n_out]
            dist.all_to_all_single(recv_ids, torch.cat(plan.dest_ids), sizes_out, sizes_in)
            bases = [sum(sizes_out[:s]) for s in range(world)]
            rplan = plan_receive(list(torch.split(recv_ids, sizes_out)), bases, to_rank, to_local, rank)
            t1 = time.perf_counter()
            out = torch.index_select(recv_x, 0, rplan.pair_row.to(dev), out=g_out[: rplan.total_pairs])
            sync()
            dist.barrier()
            t2 = time.perf_counter()
            back = g_back[: plan.total_pairs]
            a2a(back, out, plan.pair_counts, rplan.source_pairs)
            t_reduce = time.perf_counter()
            y = combine_reduce(back, plan.pair_slot, w, torch.bfloat16)
            sync()
            t3 = time.perf_counter()
            return t1 - t0, t3 - t2, y, (t_plan, t3 - t_reduce)

        # The bound: device-to-device copies of the bytes each phase moves for this rank (its token rows
        # out, its pairs' outputs back), all ranks at once on the one device.
        d2d_src = torch.zeros(tokens * topk, hidden, dtype=torch.bfloat16, device=dev)
        d2d_dst = torch.empty_like(d2d_src)

        def run_d2d(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Any:
            plan = plan_dispatch(ids, to_rank, world)
            rows_out = sum(int(t.numel()) for t in plan.dest_tokens)
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            d2d_dst[:rows_out].copy_(d2d_src[:rows_out])
            sync()
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            d2d_dst[: plan.total_pairs].copy_(d2d_src[: plan.total_pairs])
            sync()
            t3 = time.perf_counter()
            return t1 - t0, t3 - t2, None

        names = [*providers, "gloo"] + ([D2D] if device is not None else [])
        samples: dict[str, list[tuple[float, float]]] = {n: [] for n in [*names, SHARED]}
        equal = True
        for it in range(args["warmup"] + args["iters"]):
            x, ids, w = variants[it % len(variants)]
            order = list(range(len(names))) if it % 2 == 0 else list(reversed(range(len(names))))
            results: dict[str, Any] = {}
            for i in order:
                name = names[i]
                if name == "gloo":
                    results[name] = run_gloo(x, ids, w)
                elif name == D2D:
                    results[name] = run_d2d(x, ids, w)
                else:
                    results[name] = run_rfork(groups[i], x, ids, w)
            if args["wire"] == "bf16":
                equal &= all(torch.equal(results[p][2], results["gloo"][2]) for p in providers)
            if it >= args["warmup"]:
                for name in names:
                    samples[name].append((results[name][0], results[name][1]))
                samples[SHARED].append(results["gloo"][3])
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, (samples, equal, gloo_cuda[0]))
        if rank == 0:
            conn.send(("ok", everyone))
        dist.barrier()
        for ep in groups:
            ep.close()
        for eng in engines:
            eng.close()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which prints one line
        log.exception("moe bench rank %d failed", rank)
        conn.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))


def _td(seconds: float) -> Any:
    import datetime as dt

    return dt.timedelta(seconds=seconds)


def _summarise(everyone: list[Any], names: list[str]) -> tuple[dict[str, dict[str, dict[str, float]]], bool]:
    """Per name and phase: p50/p99/mean in µs of the per-iteration maximum over ranks."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in names:
        per_rank = [rank_doc[0][name] for rank_doc in everyone]
        out[name] = {}
        for p, phase in enumerate(PHASES):
            worst = sorted(
                max(rank_samples[i][p] for rank_samples in per_rank) for i in range(len(per_rank[0]))
            )
            out[name][phase] = {
                "p50_us": round(_percentile(worst, 0.50) * 1e6, 1),
                "p99_us": round(_percentile(worst, 0.99) * 1e6, 1),
                "mean_us": round(sum(worst) / len(worst) * 1e6, 1),
            }
    return out, all(rank_doc[1] for rank_doc in everyone)


def run(args: argparse.Namespace) -> int:
    """Spawn the ranks, collect their timings, print the table, optionally write JSON."""
    providers = _check(args)
    import torch.distributed as dist
    from rich.console import Console
    from rich.table import Table

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from backends import provider_available
    from bench.device_facts import machine_facts

    os.environ.setdefault("FI_TCP_IFACE", "lo")
    for p in providers:
        if not provider_available(p, "127.0.0.1" if p == "tcp" else None):
            raise RuntimeError(f"provider {p} is not available on this machine")
    load_before = os.getloadavg()
    store = dist.TCPStore("127.0.0.1", 0, None, True, _td(120), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    plain = {
        k: getattr(args, k)
        for k in ("ranks", "tokens", "hidden", "topk", "experts", "wire", "iters", "warmup", "device")
    }
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("rfork bench moe --device cuda needs a CUDA GPU (torch sees none)")
    pipes, procs = [], []
    for r in range(args.ranks):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank_main, args=(child, r, plain, providers, store.port), daemon=True)
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    try:
        reply = _first_reply(pipes, procs, timeout_s=600.0)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    if reply[0] != "ok":
        raise RuntimeError(f"moe benchmark failed: {reply[1]}")
    load_after = os.getloadavg()
    names = [*providers, "gloo"] + ([D2D] if args.device is not None else [])
    stats, equal = _summarise(reply[1], [*names, SHARED])
    gloo_cuda = reply[1][0][2]
    rows: list[dict[str, Any]] = []
    for provider in providers:
        for phase in PHASES:
            ours, base = stats[provider][phase], stats["gloo"][phase]
            rows.append(
                {
                    "provider": provider,
                    "phase": phase,
                    **{f"rfork_{k}": v for k, v in ours.items()},
                    **{f"gloo_{k}": v for k, v in base.items()},
                    "ratio_p50": round(ours["p50_us"] / base["p50_us"], 3),
                    "ratio_p99": round(ours["p99_us"] / base["p99_us"], 3),
                }
            )
            if args.device is not None:
                bound = stats[D2D][phase]
                rows[-1] |= {f"d2d_{k}": v for k, v in bound.items()}
                rows[-1]["x_of_d2d_p50"] = round(ours["p50_us"] / max(bound["p50_us"], 0.1), 2)
    table = Table(
        title=(
            f"rfork MoE, {args.ranks} ranks, {args.tokens} tokens x {args.hidden} hidden, top-{args.topk} of "
            f"{args.experts} experts, wire {args.wire} (µs; baseline: gloo all_to_all_single)"
            + ("" if args.device is None else f"; tensors on {args.device}, rfork staged through pinned host")
        )
    )
    cols = ["provider", "phase", "p50", "p99", "gloo p50", "gloo p99", "ratio p50", "ratio p99"]
    if args.device is not None:
        cols += ["d2d p50", "x of d2d p50"]
    for col in cols:
        table.add_column(col, justify="right")
    for row in rows:
        cells = [
            row["provider"],
            row["phase"],
            f"{row['rfork_p50_us']:.0f}",
            f"{row['rfork_p99_us']:.0f}",
            f"{row['gloo_p50_us']:.0f}",
            f"{row['gloo_p99_us']:.0f}",
            f"{row['ratio_p50']:.2f}",
            f"{row['ratio_p99']:.2f}",
        ]
        if args.device is not None:
            cells += [f"{row['d2d_p50_us']:.0f}", f"{row['x_of_d2d_p50']:.1f}"]
        table.add_row(*cells)
    goals = []
    if args.device is not None:
        for row in rows:
            what = f"{row['provider']} {row['phase']} p50"
            goals.append({"goal": f"{what} <= 0.5x gloo all_to_all_single", "figure": row["ratio_p50"],
                          "unit": "x of gloo", "met": row["ratio_p50"] <= 0.5})
            goals.append({"goal": f"{what} within 3x of the d2d copy bound", "figure": row["x_of_d2d_p50"],
                          "unit": "x of d2d", "met": row["x_of_d2d_p50"] <= 3.0})
    console = Console()
    console.print(table)
    shared = stats[SHARED]
    console.print(
        f"shared CPU work inside both (p50): routing plan {shared['dispatch']['p50_us']:.0f} µs, "
        f"fp32 reduction {shared['combine']['p50_us']:.0f} µs"
    )
    equal_text = "yes" if equal else "NO"
    if args.wire != "bf16":
        equal_text = "not compared (fp8 wire)"
    console.print(
        f"outputs equal to gloo's: {equal_text}; {args.iters} iterations after {args.warmup} warm-up; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; {os.cpu_count()} CPUs"
    )
    if args.device is not None:
        how = gloo_cuda if args.device == "cuda" else "host tensors"
        console.print(f"gloo on {args.device} tensors: {how}")
        for goal in goals:
            console.print(f"goal: {goal['goal']}: {goal['figure']} {goal['unit']} -> "
                          f"{'met' if goal['met'] else 'NOT met'}")
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(
                {
                    "config": plain | {"providers": providers},
                    "rows": rows,
                    "shared_cpu_us": {"plan": shared["dispatch"], "reduce": shared["combine"]},
                    "outputs_equal": equal if args.wire == "bf16" else None,
                    "load_average": {"before": load_before[0], "after": load_after[0]},
                    "cpus": os.cpu_count(),
                    "device": args.device,
                    "gloo_on_device": gloo_cuda if args.device == "cuda" else None,
                    "goals": goals,
                    "machine": machine_facts(args.device),
                },
                f,
                indent=1,
            )
    return 0 if equal or args.wire != "bf16" else 1


def _first_reply(pipes: list[Connection], procs: list[Any], *, timeout_s: float) -> Any:
    """Rank 0's result, or the first error any rank reports, or an error if a rank dies silently."""
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ready in wait(pipes, timeout=1.0):
            conn = cast(Connection, ready)
            try:
                msg = conn.recv()
            except EOFError:
                continue
            if msg[0] == "error" or conn is pipes[0]:
                return msg
        dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)]
        if dead:
            return ("error", f"rank(s) {dead} exited with status {[procs[r].exitcode for r in dead]}")
    return ("error", f"no result within {timeout_s:g}s")
