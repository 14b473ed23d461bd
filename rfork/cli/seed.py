"""Serve a checkpoint's weights to new instances (registers them read-only, publishes to the planner)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("rfork.seed.seed")


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork seed`."""
    parser.add_argument("--checkpoint", required=True, type=Path, help="safetensors checkpoint directory")
    parser.add_argument("--planner", required=True, help="planner base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument(
        "--provider",
        action="append",
        default=None,
        help="transport provider to serve on (tcp, shm, efa, verbs, auto); repeat or comma-"
        "separate for several (one planner instance each). Default tcp",
    )
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel size: one process per rank (default 1)"
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("RFORK_REGISTER_TOKEN") or os.environ.get("RFORK_TOKEN"),
        help="planner token with the register role (default $RFORK_REGISTER_TOKEN, else $RFORK_TOKEN)",
    )
    parser.add_argument(
        "--insecure-ok", action="store_true", help="allow talking to the planner without a token"
    )
    parser.add_argument(
        "--model", default=None, help="model name in the identity (default: from config.json)"
    )
    parser.add_argument("--revision", default="main", help="model revision in the identity (default main)")
    parser.add_argument("--domains", type=int, default=1, help="transport domains per engine (default 1)")
    parser.add_argument("--max-region-mib", type=int, default=256, help="largest region before splitting")
    parser.add_argument(
        "--max-concurrent-pulls", type=int, default=2, help="leases the planner may grant at once"
    )
    parser.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        help="write a JSON object (instance ids, pid) here once READY",
    )
    parser.add_argument("--no-control", action="store_true", help="do not start the NCCL control endpoint")


def _providers(values: list[str] | None) -> list[str]:
    out: list[str] = []
    for v in values or ["tcp"]:
        out += [p.strip() for p in v.split(",") if p.strip()]
    return out


def _check_args(args: argparse.Namespace) -> None:
    if args.tp < 1:
        raise ValueError("--tp must be >= 1")
    if not args.token and not args.insecure_ok:
        raise ValueError(
            "no planner token: pass --token (or $RFORK_TOKEN), or --insecure-ok for an insecure planner"
        )


def _rank_worker(
    conn: Any, directory: str, tp: int, rank: int, providers: list[str], domains: int, max_region_bytes: int
) -> None:
    """Child process for one TP rank: load its slice, register per provider, report, wait for stop."""
    import contextlib

    from rfork.seed.seed import RankServer, open_engine
    from rfork.weights.checkpoint import load_rank_from_disk, read_checkpoint_info
    from rfork.weights.rank_weights import RankWeights

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    servers: list[RankServer] = []
    try:
        layout, buffers, tensors = load_rank_from_disk(
            read_checkpoint_info(directory), tp=tp, rank=rank, max_region_bytes=max_region_bytes
        )
        weights = RankWeights(rank=rank, layout=layout, buffers=buffers, tensors=tensors)
        weights.compute_checksums()
        rows = []
        for provider in providers:
            server = RankServer(engine=open_engine(provider, domains=domains))
            servers.append(server)
            served = server.serve(weights)
            rows.append((provider, server.address_bytes(), weights.manifest(served.descriptors()).to_dict()))
        conn.send(("ok", rows))
        with contextlib.suppress(EOFError, OSError):
            conn.recv()  # "stop", or EOF when the parent died
    except Exception as exc:  # noqa: BLE001 - report to the parent, which exits non-zero
        with contextlib.suppress(Exception):
            conn.send(("error", f"rank {rank}: {exc}"))
    finally:
        for server in servers:
            server.close()


def run(args: argparse.Namespace) -> int:
    """Load, register, publish, READY, heartbeat until SIGTERM/SIGINT; then DRAINING and deregister."""
    _check_args(args)
    from rfork.seed.seed import Seed
    from rfork.weights.checkpoint import load_rank_from_disk, read_checkpoint_info
    from rfork.weights.rank_weights import RankWeights

    t0 = time.perf_counter()
    providers = _providers(args.provider)
    info = read_checkpoint_info(args.checkpoint)
    identity = info.identity(tp=args.tp, revision=args.revision, model=args.model)
    max_region = args.max_region_mib << 20
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: draining", signum)
        stop.set()

    token = args.token or None
    if args.tp == 1:
        layout, buffers, tensors = load_rank_from_disk(info, max_region_bytes=max_region)
        weights = RankWeights(rank=0, layout=layout, buffers=buffers, tensors=tensors)
        seed = Seed(
            weights=[weights],
            identity=identity,
            planner_url=args.planner,
            providers=providers,
            token=token,
            domains=args.domains,
            max_concurrent_pulls=args.max_concurrent_pulls,
            control=not args.no_control,
        )
        seed.start()
        ids = seed.instance_ids
        closer = seed.close
    else:
        ids, closer = _start_tp(args, info, identity, providers, max_region, token)
    # installed only now: opening a libfabric engine may install its own SIGTERM/SIGINT handlers
    # (the shm provider's clean-up), which would end the process without draining
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        log.info(
            "seed READY in %.2f s: %s, %d bytes, instance(s) %s",
            time.perf_counter() - t0,
            identity.model,
            info.total_bytes,
            ", ".join(ids),
        )
        if args.ready_file:
            tmp = args.ready_file.with_suffix(".tmp")
            tmp.write_text(
                json.dumps(
                    {
                        "instance_ids": ids,
                        "pid": os.getpid(),
                        "identity": identity.to_dict(),
                        "bytes": info.total_bytes,
                    }
                )
            )
            tmp.replace(args.ready_file)
        print(
            f"seed READY: {identity.model} ({info.total_bytes} bytes) as {', '.join(ids)}; Ctrl-C to stop",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
    finally:
        closer()
    return 0


def _worker_result(rank: int, conn: Any) -> Any:
    if not conn.poll(600):
        raise TimeoutError(f"rank {rank} worker did not report within 600 s")
    status, payload = conn.recv()
    if status != "ok":
        raise RuntimeError(payload)
    return payload


def _start_tp(
    args: argparse.Namespace,
    info: Any,
    identity: Any,
    providers: list[str],
    max_region: int,
    token: str | None,
) -> tuple[list[str], Any]:
    import base64
    import multiprocessing as mp

    from rfork.seed.seed import Publication

    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in range(args.tp):
        parent, child = ctx.Pipe()
        p = ctx.Process(
            target=_rank_worker,
            args=(child, str(info.directory), args.tp, rank, providers, args.domains, max_region),
            daemon=True,
        )
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    pubs: list[Any] = []

    def close() -> None:
        for pub in pubs:
            pub.close()
        for c in conns:
            try:
                c.send("stop")
            except OSError:
                log.debug("rank worker pipe already closed")
        for p in procs:
            p.join(timeout=15)
            if p.is_alive():
                p.kill()

    try:
        results = [_worker_result(rank, c) for rank, c in enumerate(conns)]
        for i, provider in enumerate(providers):
            rows, manifests = [], {}
            for rank, per_provider in enumerate(results):
                prov, address, manifest = per_provider[i]
                assert prov == provider
                rows.append(
                    {
                        "rank": rank,
                        "provider": provider,
                        "address": base64.b64encode(address).decode(),
                        "backends": [provider],
                    }
                )
                manifests[rank] = manifest
            pubs.append(
                Publication(
                    planner_url=args.planner,
                    token=token,
                    identity=identity,
                    ranks=rows,
                    manifests=manifests,
                    max_concurrent_pulls=args.max_concurrent_pulls,
                )
            )
    except BaseException:
        close()
        raise
    return [str(p.instance_id) for p in pubs], close
