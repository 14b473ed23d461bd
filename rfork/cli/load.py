"""Start an instance by pulling its weights from a seed (else NCCL, else disk), then serve as a seed."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

from rfork.cli.tokens import add_token_file, read_token

log = logging.getLogger("rfork.load")


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork load`."""
    parser.add_argument(
        "--checkpoint-id",
        default=None,
        help="MODEL[@REVISION]: take the identity from a READY seed of that model on the planner",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="local checkpoint directory: gives the identity and the disk fallback",
    )
    parser.add_argument("--planner", default=None, help="planner base URL (without one: disk only)")
    parser.add_argument(
        "--provider",
        action="append",
        default=None,
        help="transport provider(s) this instance speaks (default tcp)",
    )
    parser.add_argument(
        "--tp", type=int, default=None, help="tensor-parallel size (default: identity's or 1)"
    )
    add_token_file(parser, "--token-file", env=("RFORK_TOKEN",), role="load")
    add_token_file(
        parser, "--register-token-file", env=("RFORK_REGISTER_TOKEN",), role="register (to become a seed)"
    )
    parser.add_argument(
        "--insecure-ok", action="store_true", help="allow talking to the planner without a token"
    )
    parser.add_argument("--exclude", action="append", default=[], help="never pull from this instance id")
    parser.add_argument(
        "--then",
        choices=("serve", "exit"),
        default="serve",
        help="after loading: serve as a seed until SIGTERM (default), or exit",
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="dead-peer timeout for transfers, seconds")
    parser.add_argument("--chunk-mib", type=int, default=8, help="bytes per read (MiB, default 8)")
    parser.add_argument("--inflight", type=int, default=8, help="reads in flight (default 8)")
    parser.add_argument(
        "--fallback-gbps",
        type=float,
        default=2.0,
        help="checkpoint read rate, GB/s, that the planner weighs against waiting for a busy seed "
        "(0: never fall back while seeds are busy; default 2)",
    )
    parser.add_argument(
        "--max-concurrent-pulls", type=int, default=2, help="pull limit once this instance is a seed"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the outcome as JSON here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def resolve_identity(args: argparse.Namespace) -> tuple[Any, Any]:
    """(identity, checkpoint info or None) from --checkpoint and/or --checkpoint-id."""
    # imported here: `rfork --help` imports every command module, which must stay light (start-up time)
    from rfork.identity import SourceIdentity
    from rfork.weights.checkpoint import read_checkpoint_info

    info = read_checkpoint_info(args.checkpoint) if args.checkpoint else None
    if args.checkpoint_id is None:
        if info is None:
            raise ValueError("give --checkpoint-id MODEL[@REV] or --checkpoint DIR")
        return info.identity(tp=args.tp or 1), info
    if args.planner is None:
        raise ValueError("--checkpoint-id needs --planner")
    model, _, revision = args.checkpoint_id.partition("@")
    from planner.contract import PlannerClient

    with PlannerClient(args.planner, token=args.token or None) as client:
        listing = client.list_instances(model=model, status="READY", limit=100)
    for item in listing.items:
        ident = item.identity
        if (revision and ident.get("revision") != revision) or (args.tp and ident.get("tp") != args.tp):
            continue
        if info is not None and ident.get("fingerprint") != info.fingerprint():
            continue
        return SourceIdentity.model_validate(ident), info
    if info is not None:
        return info.identity(tp=args.tp or 1), info
    raise ValueError(f"no READY seed of {args.checkpoint_id!r} on {args.planner} and no --checkpoint to load")


def run(args: argparse.Namespace) -> int:
    """Load (R-Fork, NCCL or disk), verify, report; then serve or exit."""
    started = time.time()
    args.token = read_token(args.token_file, env=("RFORK_TOKEN",))
    args.register_token = read_token(args.register_token_file, env=("RFORK_REGISTER_TOKEN",))
    if args.planner and not args.token and not args.insecure_ok:
        raise ValueError("no planner token: set $RFORK_TOKEN (or pass --token-file), or --insecure-ok")
    # imported here: `rfork --help` imports every command module, which must stay light (start-up time)
    from rfork.pull.loader import Loader
    from rfork.pull.one_sided import warm_transport
    from rfork.pull.result import LoadOptions

    providers = [p.strip() for v in (args.provider or ["tcp"]) for p in v.split(",") if p.strip()]
    if args.planner:
        warm_transport(providers)  # while the identity is resolved below
    identity, info = resolve_identity(args)
    options = LoadOptions(
        providers=providers,
        chunk_bytes=args.chunk_mib << 20,
        max_inflight=args.inflight,
        transfer_timeout_s=args.timeout,
        exclude=args.exclude,
        become_seed=args.then == "serve",
        fallback_gbps=args.fallback_gbps or None,
        max_concurrent_pulls=args.max_concurrent_pulls,
    )
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    progress, finish = _progress_bar(enabled=not args.no_progress)
    loader = Loader(
        identity=identity,
        planner_url=args.planner,
        token=args.token or None,
        register_token=args.register_token or None,
        checkpoint=info,
        options=options,
        progress=progress,
    )
    # The engine opens on a helper thread and the planner client is built now, as a framework hook
    # would do while it builds its model; `seconds` in the output counts from the load call on.
    loader.prepare()
    try:
        result = loader.load()
    finally:
        finish()
    try:
        _report_and_serve(args, result, started, stop, on_signal)
    except KeyboardInterrupt:
        log.info("interrupted: draining")
    finally:
        result.close()  # also on an error (e.g. a full disk for --json): drain, never leave a stray seed
    return 0


def _report_and_serve(
    args: argparse.Namespace, result: Any, started: float, stop: Any, on_signal: Any
) -> None:
    """Write --json, print the outcome, then serve as a seed until told to stop."""
    verified_at = time.time()
    # after the engine opened: libfabric may have replaced the handlers (see rfork.cli.seed)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    out = {
        "source": result.source,
        "bytes": result.bytes,
        "seconds": result.seconds,
        "gb_per_s": result.bytes / max(result.seconds, 1e-9) / 1e9,
        "verified": result.verified,
        "since_start_s": verified_at - started,
        "verified_at": verified_at,
        "attempts": [a.__dict__ for a in result.attempts],
        "phases": result.phases,
        "instance_ids": result.seed.instance_ids if result.seed else [],
    }
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(out, allow_nan=False))
            tmp.replace(args.json)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
    print(
        f"loaded {result.bytes} bytes from {result.source} in {result.seconds:.2f} s "
        f"({out['gb_per_s']:.2f} GB/s), "
        + ("checksums verified" if result.verified else "not verified (disk: no digests to compare)"),
        flush=True,
    )
    if result.seed is not None:
        print(f"serving as seed {', '.join(result.seed.instance_ids)}; Ctrl-C to stop", flush=True)
        while not stop.wait(0.5):
            pass


def _progress_bar(*, enabled: bool) -> tuple[Any, Any]:
    if not enabled:
        return None, lambda: None
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        transient=True,
    )
    task = bar.add_task("pulling weights", total=None)
    bar.start()

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    return update, bar.stop
