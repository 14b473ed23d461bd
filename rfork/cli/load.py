"""Start an instance by pulling its weights from a seed (else NCCL, else disk), then serve as a seed."""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from rfork.cli import signals
from rfork.cli.logs import human_bytes, progress_bar, say
from rfork.cli.options import (
    add_insecure,
    add_max_pulls,
    add_metrics,
    add_planner,
    add_provider,
    env,
    providers_of,
)
from rfork.cli.tokens import add_token_file, read_token
from rfork.errors import ConfigurationError

log = logging.getLogger("rfork.load")

DESCRIPTION = """Start an instance by pulling its weights from a seed (else NCCL, else disk), then
serve as a seed.

A wrong setting (a planner URL that is not one, an unknown or absent provider, a missing or refused
token) stops at once with one line and status 2. An outage (planner unreachable, no seed, every seed
busy, failed pulls) loads from disk with a WARNING saying why, unless --require-seed. SIGINT/SIGTERM
during the pull releases the lease and exits 130/143. Topology labels: $RFORK_NODE, $RFORK_RACK,
$RFORK_ZONE (default: the hostname, rack0, zone0)."""

# what to change for each setting a ConfigurationError names (rfork.cli.main adds it to the line)
FIXES = {
    "token": "the load token: --token-file, $RFORK_TOKEN or $RFORK_TOKEN_FILE; or --insecure for a planner "
    "without auth",
    "register_token": "a token with the register role: --register-token-file, $RFORK_REGISTER_TOKEN or "
    "$RFORK_REGISTER_TOKEN_FILE; or --no-serve",
}
INTERRUPTED = "the load stopped; no lease is held and nothing is served"


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork load`."""
    parser.add_argument(
        "--checkpoint-id",
        default=None,
        metavar="MODEL[@REVISION]",
        help="take the identity from a READY seed of that model on the planner",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="local checkpoint directory: gives the identity and the disk fallback",
    )
    add_planner(parser, what="planner base URL (without one: disk only)")
    add_provider(parser, what="transport provider(s) this instance speaks")
    parser.add_argument(
        "--tp", type=int, default=None, help="tensor-parallel size (default: identity's or 1)"
    )
    add_token_file(parser, "--token-file", env=("RFORK_TOKEN",), role="load")
    add_token_file(
        parser, "--register-token-file", env=("RFORK_REGISTER_TOKEN",), role="register (to become a seed)"
    )
    add_insecure(parser)
    parser.add_argument("--exclude", action="append", default=[], help="never pull from this instance id")
    parser.add_argument(
        "--no-serve",
        action="store_true",
        help="exit after loading instead of serving as a seed until SIGTERM",
    )
    parser.add_argument(
        "--then", choices=("serve", "exit"), default=None, help=argparse.SUPPRESS
    )  # old spelling
    parser.add_argument(
        "--require-seed",
        action="store_true",
        default=(env("RFORK_REQUIRE_SEED", "") or "").lower() in ("1", "true", "yes", "on"),
        help="fail (status 1) instead of loading from disk when no seed serves a rank "
        "(default: $RFORK_REQUIRE_SEED, else off)",
    )
    parser.add_argument(
        "--require-crypto-digest",
        action="store_true",
        default=(env("RFORK_REQUIRE_CRYPTO_DIGEST", "") or "").lower() in ("1", "true", "yes", "on"),
        help="refuse to pull unless the digest is cryptographic (BLAKE3; $RFORK_DIGEST): stop with "
        "status 2 under xxh3-128 or pmix64-v1 (default: $RFORK_REQUIRE_CRYPTO_DIGEST, else off)",
    )
    parser.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="dead-peer timeout for transfers"
    )
    parser.add_argument("--chunk-mib", type=int, default=8, help="bytes per read, MiB")
    parser.add_argument("--inflight", type=int, default=8, help="reads in flight")
    parser.add_argument(
        "--fallback-gbps",
        type=float,
        default=2.0,
        help="checkpoint read rate, GB/s, that the planner weighs against waiting for a busy seed "
        "(0: never fall back while seeds are busy; default 2)",
    )
    parser.add_argument(
        "--planner-outage-s",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="keep asking a planner that cannot be reached (restarting, failing over) this long before "
        "loading from disk, or failing under --require-seed (default 30)",
    )
    add_max_pulls(parser)
    parser.add_argument("--json", type=Path, default=None, help="write the outcome as JSON here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_metrics(parser)


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


def check_settings(args: argparse.Namespace) -> list[str]:
    """Every setting that no fallback can fix, checked before anything starts; the provider names."""
    # imported here: `rfork --help` imports every command module, which must stay light (start-up time)
    from rfork.pull.checks import check_planner_url, check_provider_names, check_providers_present

    args.token = read_token(args.token_file, env=("RFORK_TOKEN",))
    args.register_token = read_token(args.register_token_file, env=("RFORK_REGISTER_TOKEN",))
    args.planner = check_planner_url(args.planner)
    providers = check_provider_names(providers_of(args.provider))
    if args.planner and not args.token and not args.insecure:
        raise ConfigurationError("no planner token given", setting="token")
    if args.require_seed and not args.planner:
        raise ConfigurationError("--require-seed needs a planner to ask for a seed", setting="planner_url")
    if not args.planner_outage_s >= 0:
        raise ConfigurationError(
            f"--planner-outage-s must be 0 or more seconds, not {args.planner_outage_s}",
            setting="planner_outage_s",
        )
    if args.planner:
        check_providers_present(providers)  # probes libfabric on this (main) thread, which ...
        signals.install()  # ... replaced our handlers with its own: put them back
    return providers


def run(args: argparse.Namespace) -> int:
    """Load (R-Fork, NCCL or disk), verify, report; then serve or exit."""
    started = time.time()
    signals.install()  # from here a signal unwinds the load: lease released, engine closed
    serve = not args.no_serve and args.then != "exit"
    providers = check_settings(args)
    # imported here: `rfork --help` imports every command module, which must stay light (start-up time)
    from rfork import metrics
    from rfork.loader import Loader
    from rfork.pull.one_sided import warm_transport
    from rfork.pull.options import BusyWait, LoadOptions

    if args.metrics_port is not None:
        metrics.serve_metrics(args.metrics_port, args.metrics_host)
    if args.planner:
        warm_transport(providers)  # while the identity is resolved below
    identity, info = resolve_identity(args)
    options = LoadOptions(
        providers=providers,
        chunk_bytes=args.chunk_mib << 20,
        max_inflight=args.inflight,
        transfer_timeout_s=args.timeout,
        exclude=args.exclude,
        become_seed=serve,
        fallback_gbps=args.fallback_gbps or None,
        busy_wait=BusyWait(planner_outage_s=args.planner_outage_s),
        max_concurrent_pulls=args.max_concurrent_pulls,
        require_seed=args.require_seed,
        require_crypto_digest=args.require_crypto_digest,
    )
    with progress_bar("loading weights", enabled=not args.no_progress) as update:
        loader = Loader(
            identity=identity,
            planner_url=args.planner,
            token=args.token or None,
            register_token=args.register_token or None,
            checkpoint=info,
            options=options,
            progress=update,
        )
        # The engine opens on a helper thread and the planner client is built now, as a framework hook
        # would do while it builds its model; `seconds` in the output counts from the load call on.
        loader.prepare()
        result = loader.load()
    try:
        _check_seed(result, serve)
        _report_and_serve(args, result, started)
    finally:
        result.close()  # also on an error (e.g. a full disk for --json): drain, never leave a stray seed
    return 0


def _check_seed(result: Any, serve: bool) -> None:
    """The load asked to serve but could not become a seed: a refused token is a setting; else an error."""
    if not serve or result.seed_error is None:
        return
    if result.seed_error.startswith("AuthError"):
        raise ConfigurationError(
            f"loaded, but the planner refused to register this instance as a seed ({result.seed_error})",
            setting="register_token",
        )
    raise RuntimeError(f"loaded, but could not become a seed: {result.seed_error}")


def _report_and_serve(args: argparse.Namespace, result: Any, started: float) -> None:
    """Write --json, print the outcome, then serve as a seed until SIGTERM/SIGINT."""
    verified_at = time.time()
    stop = threading.Event()
    signals.install(lambda _signum, _frame: stop.set())  # serving: a signal drains, status 0
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
    say(
        f"loaded {human_bytes(result.bytes)} from {result.source} in {result.seconds:.2f} s "
        f"({out['gb_per_s']:.2f} GB/s), "
        + ("checksums verified" if result.verified else "not verified (disk: no digests to compare)"),
        source=result.source,
        bytes=result.bytes,
        seconds=result.seconds,
        verified=result.verified,
    )
    if result.seed is not None:
        # imported here: `rfork --help` imports every command module, which must stay light (start-up time)
        from rfork import metrics

        metrics.SEED_BYTES.set(result.bytes)
        metrics.SEED_INSTANCES.set(len(result.seed.instance_ids))
        ids = result.seed.instance_ids
        say(f"serving as seed {', '.join(ids)}; Ctrl-C to stop", instance_ids=ids)
        while not stop.wait(0.5):
            pass
        log.info("draining")
