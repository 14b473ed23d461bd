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

from rfork.cli.tokens import add_token_file, read_token

log = logging.getLogger("rfork.seed")


# a disk seed on a trusted host holds the anchor role: its publication sets the identity's digests
SEED_TOKEN_ENV = ("RFORK_ANCHOR_TOKEN", "RFORK_REGISTER_TOKEN", "RFORK_TOKEN")


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork seed`."""
    parser.add_argument("--checkpoint", required=True, type=Path, help="safetensors checkpoint directory")
    parser.add_argument("--planner", required=True, help="planner base URL, e.g. http://127.0.0.1:8470")
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
    add_token_file(parser, "--token-file", env=SEED_TOKEN_ENV, role="register (or anchor)")
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
    args.token = read_token(args.token_file, env=SEED_TOKEN_ENV)
    if not args.token and not args.insecure_ok:
        raise ValueError(
            "no planner token: set $RFORK_ANCHOR_TOKEN or $RFORK_REGISTER_TOKEN (or pass --token-file),"
            " or --insecure-ok for an insecure planner"
        )


def run(args: argparse.Namespace) -> int:
    """Load, register, publish, READY, heartbeat until SIGTERM/SIGINT; then DRAINING and deregister."""
    _check_args(args)
    # imported here: `rfork --help` imports every command module (start-up time)
    from rfork.seed.checkpoint_seed import serve_checkpoint
    from rfork.weights.checkpoint import read_checkpoint_info

    t0 = time.perf_counter()
    info = read_checkpoint_info(args.checkpoint)
    identity = info.identity(tp=args.tp, revision=args.revision, model=args.model)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: draining", signum)
        stop.set()

    ids, closer = serve_checkpoint(
        info,
        identity=identity,
        planner_url=args.planner,
        providers=_providers(args.provider),
        token=args.token or None,
        domains=args.domains,
        max_region_bytes=args.max_region_mib << 20,
        max_concurrent_pulls=args.max_concurrent_pulls,
        control=not args.no_control,
    )
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
            ready = {
                "instance_ids": ids,
                "pid": os.getpid(),
                "identity": identity.model_dump(),
                "bytes": info.total_bytes,
            }
            tmp.write_text(json.dumps(ready))
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
