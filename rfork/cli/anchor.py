"""Anchor an identity's digests from a checkpoint in one command: upload, list, revoke (admin token)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rfork.cli.digest import anchor_bodies
from rfork.cli.logs import say
from rfork.cli.options import add_insecure, add_planner
from rfork.cli.tokens import add_token_file, read_token

DESCRIPTION = """Anchor an identity's digests, the set every seed's manifest must match:

  rfork anchor upload --checkpoint DIR [--tp N --model-name M --revision R]  digest it, PUT each rank
  rfork anchor upload --from anchors.json         the bodies `rfork digest --out` wrote
  rfork anchor list [--checkpoint DIR ...]        every anchor, or that identity's
  rfork anchor revoke --checkpoint DIR [--rank R] nobody serves it until it is anchored again

The identity is the one `rfork seed` with the same --tp, --model-name and --revision registers.
Needs a token with the admin role (--token-file, $RFORK_ADMIN_TOKEN or $RFORK_ADMIN_TOKEN_FILE)."""

FIXES = {"token": "an admin token: --token-file, $RFORK_ADMIN_TOKEN or $RFORK_ADMIN_TOKEN_FILE"}
TOKEN_ENV = ("RFORK_ADMIN_TOKEN",)


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork anchor`."""
    parser.add_argument("action", choices=("upload", "list", "revoke"), help="what to do")
    add_planner(parser)
    add_token_file(parser, "--token-file", env=TOKEN_ENV, role="admin")
    add_insecure(parser)
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="safetensors checkpoint directory or .safetensors file"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size the seeds serve")
    parser.add_argument(
        "--model-name", "--model", dest="model_name", default=None, help="model name in the identity"
    )
    parser.add_argument("--revision", default="main", help="model revision in the identity")
    parser.add_argument(
        "--from",
        dest="from_file",
        type=Path,
        default=None,
        help="upload: the bodies `rfork digest --out` wrote",
    )
    parser.add_argument("--rank", type=int, default=None, help="revoke: this rank only (default: every rank)")
    parser.add_argument("--json", action="store_true", help="list: print the planner's JSON answer")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Upload, list or revoke."""
    # imported here: `rfork --help` imports every command module, which must stay light (start-up time)
    from planner.contract import AuthError, PlannerClient
    from rfork.errors import ConfigurationError
    from rfork.pull.checks import check_planner_url

    url = check_planner_url(args.planner)
    if url is None:
        raise ConfigurationError("no planner given", setting="planner_url")
    token = read_token(args.token_file, env=TOKEN_ENV)
    if not token and not args.insecure:
        raise ConfigurationError("no admin token given", setting="token")
    with PlannerClient(url, token=token) as client:
        try:
            return _act(args, client)
        except AuthError as exc:
            raise ConfigurationError(f"the planner refused the token: {exc}", setting="token") from exc


def _identity_key(args: argparse.Namespace) -> str:
    # imported here: `rfork --help` imports every command module, which must stay light (start-up time)
    from rfork.weights.checkpoint import read_checkpoint_info

    info = read_checkpoint_info(args.checkpoint)
    return info.identity(tp=args.tp, revision=args.revision, model=args.model_name).key()


def _act(args: argparse.Namespace, client: Any) -> int:
    if args.action == "upload":
        if args.from_file is not None:
            bodies = json.loads(args.from_file.read_text(encoding="utf-8"))
        elif args.checkpoint is not None:
            bodies = anchor_bodies(args)
        else:
            raise ValueError("upload needs --checkpoint DIR or --from FILE")
        for body in bodies:
            view = client.put_anchor(body)
            say(
                f"anchored {body['identity']['model']} rank {view.rank} ({view.checksum_algorithm}, "
                f"{view.tensors} tensors): digest set {view.digest_set[:16]}, "
                f"identity {view.identity_key[:12]}"
            )
        return 0
    key = _identity_key(args) if args.checkpoint is not None else None
    page = client.list_anchors(identity_key=key)
    if args.action == "list":
        if args.json:
            print(json.dumps(page.model_dump(mode="json")))
        for a in [] if args.json else page.items:
            say(
                f"{a.identity_key[:12]} rank {a.rank} {a.checksum_algorithm} {a.digest_set[:16]} "
                f"({a.tensors} tensors) set by {a.set_by}"
            )
        if not args.json and not page.items:
            say("no anchors" + (f" for identity {key[:12]}" if key else ""))
        return 0
    if key is None:
        raise ValueError("revoke needs --checkpoint DIR (with the identity's --tp, --model-name, --revision)")
    chosen = [a for a in page.items if args.rank is None or a.rank == args.rank]
    if not chosen:
        raise ValueError(
            f"identity {key[:12]} has no anchor" + (f" for rank {args.rank}" if args.rank else "")
        )
    for a in chosen:
        client.revoke_anchor(a.identity_key, a.rank, a.checksum_algorithm)
        say(f"revoked {a.identity_key[:12]} rank {a.rank} {a.checksum_algorithm}")
    return 0
