"""Serve a checkpoint's weights to new instances (registers them read-only, publishes to the planner)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
from pathlib import Path

from rfork.cli import signals
from rfork.cli.logs import human_bytes, progress_bar, say
from rfork.cli.options import (
    add_insecure,
    add_max_pulls,
    add_metrics,
    add_model_name,
    add_planner,
    add_provider,
)
from rfork.cli.tokens import add_token_file, read_token

log = logging.getLogger("rfork.seed")

DESCRIPTION = """Serve a checkpoint's weights to new instances: read it into memory, register it
read-only with the transport, publish it to the planner and heartbeat until SIGTERM/SIGINT, then
drain. A wrong setting or a refused token stops at once (status 2). Topology labels: $RFORK_NODE,
$RFORK_RACK, $RFORK_ZONE."""

# a disk seed on a trusted host holds the anchor role: its publication sets the identity's digests
SEED_TOKEN_ENV = ("RFORK_ANCHOR_TOKEN", "RFORK_REGISTER_TOKEN", "RFORK_TOKEN")
FIXES = {
    "token": "a token with the register (or anchor) role: --token-file, $RFORK_ANCHOR_TOKEN, "
    "$RFORK_REGISTER_TOKEN (or their _FILE forms); or --insecure for a planner without auth",
}
INTERRUPTED = "stopped before it was READY; nothing is served"


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork seed`."""
    parser.add_argument(
        "--checkpoint", required=True, type=Path, help="safetensors checkpoint directory or .safetensors file"
    )
    add_planner(parser)
    add_provider(parser, what="transport provider(s) to serve on, one planner instance each")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size: one process per rank")
    add_token_file(parser, "--token-file", env=SEED_TOKEN_ENV, role="register (or anchor)")
    add_insecure(parser)
    add_model_name(parser)
    parser.add_argument("--revision", default="main", help="model revision in the identity")
    parser.add_argument("--domains", type=int, default=1, help="transport domains per engine")
    parser.add_argument(
        "--max-region-mib", type=int, default=256, help="largest region before splitting, MiB"
    )
    add_max_pulls(parser)
    parser.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        help="write a JSON object (instance ids, pid) here once READY",
    )
    parser.add_argument("--no-control", action="store_true", help="do not start the NCCL control endpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while it starts")
    add_metrics(parser)


def _check_args(args: argparse.Namespace) -> list[str]:
    """Every setting no retry can fix, before the checkpoint is read; the providers."""
    # imported here: `rfork --help` imports every command module, which must stay light (start-up time)
    from rfork.cli.options import providers_of
    from rfork.errors import ConfigurationError
    from rfork.pull.checks import check_planner_url, check_provider_names, check_providers_present

    if args.tp < 1:
        raise ValueError("--tp must be >= 1")
    args.planner = check_planner_url(args.planner)
    if args.planner is None:
        raise ConfigurationError("no planner given", setting="planner_url")
    args.token = read_token(args.token_file, env=SEED_TOKEN_ENV)
    if not args.token and not args.insecure:
        raise ConfigurationError("no planner token given", setting="token")
    providers = check_provider_names(providers_of(args.provider))
    check_providers_present(providers)  # probes libfabric on this (main) thread, which ...
    signals.install()  # ... replaced our handlers with its own: put them back
    return providers


def run(args: argparse.Namespace) -> int:
    """Load, register, publish, READY, heartbeat until SIGTERM/SIGINT; then DRAINING and deregister."""
    signals.install()
    providers = _check_args(args)
    # imported here: `rfork --help` imports every command module (start-up time)
    from planner.contract import AuthError
    from rfork import metrics
    from rfork.errors import ConfigurationError
    from rfork.seed.checkpoint_seed import serve_checkpoint
    from rfork.weights.checkpoint import read_checkpoint_info

    if args.metrics_port is not None:
        metrics.serve_metrics(args.metrics_port, args.metrics_host)
    t0 = time.perf_counter()
    info = read_checkpoint_info(args.checkpoint)
    identity = info.identity(tp=args.tp, revision=args.revision, model=args.model_name)
    what = f"{identity.model}: reading {human_bytes(info.total_bytes)}, digesting, publishing"
    with progress_bar(what, enabled=not args.no_progress, unit="none"):
        try:
            ids, closer = serve_checkpoint(
                info,
                identity=identity,
                planner_url=args.planner,
                providers=providers,
                token=args.token or None,
                domains=args.domains,
                max_region_bytes=args.max_region_mib << 20,
                max_concurrent_pulls=args.max_concurrent_pulls,
                control=not args.no_control,
            )
        except AuthError as exc:
            raise ConfigurationError(
                f"the planner refused to register the seed: {exc}", setting="token"
            ) from exc
    stop = threading.Event()
    # installed again now: opening a libfabric engine may install its own SIGTERM/SIGINT handlers (the shm
    # provider's clean-up), which would end the process without draining; serving, a signal drains
    signals.install(lambda _signum, _frame: stop.set())
    metrics.SEED_BYTES.set(info.total_bytes)
    metrics.SEED_INSTANCES.set(len(ids))
    try:
        log.info(
            "seed READY in %.2f s: %s, %s, instance(s) %s",
            time.perf_counter() - t0,
            identity.model,
            human_bytes(info.total_bytes),
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
        say(
            f"seed READY: {identity.model} ({human_bytes(info.total_bytes)}) as {', '.join(ids)}; "
            "Ctrl-C to stop",
            instance_ids=ids,
        )
        while not stop.wait(0.5):
            pass
        log.info("draining")
    finally:
        closer()
    return 0
