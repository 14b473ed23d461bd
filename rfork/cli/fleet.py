"""Show the fleet from a terminal: identities, instances (seeds) and live pulls (a reader token)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from rfork.cli.logs import human_bytes
from rfork.cli.options import add_insecure, add_planner
from rfork.cli.tokens import add_token_file, read_token

DESCRIPTION = """Show the fleet from a terminal: what the fleet page (/ui) shows, from the same
GET /v1/fleet, for a token with the reader role: each identity (model, layout, anchor state), each
instance (state, labels, pulls against its limit, heartbeat age, quarantine) and each live pull (seed
-> loader, bytes done, GB/s). --json prints the planner's answer as it came; --watch redraws."""

FIXES = {"token": "a reader token: --token-file, $RFORK_READER_TOKEN or $RFORK_READER_TOKEN_FILE"}
TOKEN_ENV = ("RFORK_READER_TOKEN", "RFORK_TOKEN")


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork fleet`."""
    add_planner(parser)
    add_token_file(parser, "--token-file", env=TOKEN_ENV, role="reader (any role will do)")
    add_insecure(parser)
    parser.add_argument("--json", action="store_true", help="print the planner's JSON answer instead")
    parser.add_argument(
        "--watch", type=float, default=None, metavar="SECONDS", help="redraw every SECONDS until Ctrl-C"
    )


def run(args: argparse.Namespace) -> int:
    """Ask the planner once (or every --watch seconds) and print the fleet."""
    # imported here: `rfork --help` imports every command module, which must stay light (start-up time)
    from planner.contract import AuthError, PlannerClient
    from rfork.errors import ConfigurationError
    from rfork.pull.checks import check_planner_url

    url = check_planner_url(args.planner)
    if url is None:
        raise ConfigurationError("no planner given", setting="planner_url")
    token = read_token(args.token_file, env=TOKEN_ENV)
    if not token and not args.insecure:
        raise ConfigurationError("no planner token given", setting="token")
    with PlannerClient(url, token=token) as client:
        while True:
            try:
                view = client.fleet()
            except AuthError as exc:
                raise ConfigurationError(f"the planner refused the token: {exc}", setting="token") from exc
            if args.json:
                sys.stdout.write(json.dumps(view.model_dump(mode="json")) + "\n")
            else:
                print_fleet(view, clear=args.watch is not None)
            if args.watch is None:
                return 0
            time.sleep(max(args.watch, 0.2))


def print_fleet(view: Any, *, clear: bool = False) -> None:
    """Three tables on stdout (full width outside a terminal: nothing is cut)."""
    # imported here: `rfork --help` imports every command module, which must stay light (start-up time)
    from rich.console import Console
    from rich.table import Table

    out = Console(highlight=False)
    if not out.is_terminal:
        out = Console(highlight=False, width=200)
    if clear:
        out.clear()
    models = {d.identity_key: d.model for d in view.identities}
    idents = Table(title="identities", title_justify="left")
    for col in ("model", "revision", "framework", "dtype", "layout", "anchor", "instances"):
        idents.add_column(col)
    counts: dict[str, int] = {}
    for i in view.instances:
        counts[i.identity_key] = counts.get(i.identity_key, 0) + 1
    for d in view.identities:
        anchor = (
            "; ".join(
                f"rank {a.rank} {a.checksum_algorithm} ({'' if a.cryptographic else 'not '}cryptographic) "
                f"{a.digest_set}"
                for a in d.anchors
            )
            if d.anchors
            else "not anchored"
        )
        idents.add_row(
            d.model, d.revision, d.framework, d.dtype, d.layout, anchor, str(counts.get(d.identity_key, 0))
        )
    out.print(idents)
    seeds = Table(title="instances", title_justify="left")
    for col in ("instance", "model", "state", "node", "rack", "zone", "pulls", "heartbeat age"):
        seeds.add_column(col)
    for i in view.instances:
        state = i.status.value + (f" (quarantined: {i.quarantine_reason})" if i.quarantine_reason else "")
        seeds.add_row(
            i.id,
            models.get(i.identity_key, i.identity_key[:12]),
            state,
            i.labels.node,
            i.labels.rack,
            i.labels.zone,
            f"{i.pulls} / {i.max_concurrent_pulls}",
            f"{i.heartbeat_age_s:.1f} s",
        )
    out.print(seeds)
    live = [e for e in view.edges if e.live]
    pulls = Table(title=f"live pulls ({len(live)})", title_justify="left")
    for col in ("seed", "loader", "rank", "transport", "done", "GB/s", "running"):
        pulls.add_column(col)
    for e in live:
        done = human_bytes(e.bytes_done) + (f" / {human_bytes(e.bytes_total)}" if e.bytes_total else "")
        pulls.add_row(
            e.seed_id,
            e.loader_id or "(loading)",
            str(e.rank),
            e.transport,
            done,
            "?" if e.gbps is None else f"{e.gbps:.2f}",
            f"{view.now - e.started_at:.1f} s",
        )
    out.print(pulls)
    if view.refusals:
        last = view.refusals[-1]
        model = models.get(last.identity_key, "?")
        out.print(f"latest refusal: {last.reason} ({model} rank {last.rank}): {last.detail}")
