"""The `rfork` command line: one entry point, one module per command.

Each command module has `configure(parser)` and `run(args) -> int` and keeps its top-level imports
light (no torch, no FastAPI, no transport): every one of them is imported here, so `rfork --help`
stays instant. They import what they need inside `run`, with a comment saying so. `rfork demo`,
`rfork bench ...` and `rfork simulate ...` run from a source checkout (rfork/cli/checkout_commands.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from rfork import __version__
from rfork.cli import checkout_commands, digest, load, planner_migrate, planner_serve, seed, sglang, vllm
from rfork.errors import NEEDS_TORCH

# (command path, implementing module). Groups ("planner") are created on the way. `rfork demo`,
# `rfork bench ...` and `rfork simulate ...` come from the checkout's bench/ (checkout_commands.py).
COMMANDS: checkout_commands.Commands = (
    (("planner", "serve"), planner_serve),
    (("planner", "migrate"), planner_migrate),
    (("seed",), seed),
    (("load",), load),
    (("digest",), digest),
    (("sglang",), sglang),
    (("vllm",), vllm),
)

GROUP_HELP = {"planner": "run or migrate the planner service", **checkout_commands.WORDS}

log = logging.getLogger("rfork")


def _summary(module: ModuleType) -> str:
    doc = (module.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""


def build_parser(from_checkout: checkout_commands.Commands = ()) -> argparse.ArgumentParser:
    """The whole command tree; each leaf parser carries its module in `_module`.

    Without `from_checkout` (checkout_commands.load()), `demo`, `bench` and `simulate` are listed with
    their help only: `rfork --help` does not import bench/.
    """
    parser = argparse.ArgumentParser(prog="rfork", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"rfork {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]] = {}
    for path, module in (*COMMANDS, *from_checkout):
        subs = top
        for i, word in enumerate(path[:-1]):
            key = " ".join(path[: i + 1])
            if key not in groups:
                group = subs.add_parser(word, help=GROUP_HELP.get(word), description=GROUP_HELP.get(word))
                groups[key] = group.add_subparsers(dest=f"{word}_command", metavar="COMMAND", required=True)
            subs = groups[key]
        summary = _summary(module)
        # no abbreviations: `--token` must be refused, not read as `--token-file`
        leaf = subs.add_parser(path[-1], help=summary, description=summary, allow_abbrev=False)
        module.configure(leaf)
        leaf.set_defaults(_module=module)
    loaded = {path[0] for path, _ in from_checkout}
    for word, text in checkout_commands.WORDS.items():
        if word not in loaded:
            top.add_parser(word, help=text, description=text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (non-zero with a one-line error on failure)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    word = next((a for a in argv if not a.startswith("-")), None)  # the global options take no value
    from_checkout: checkout_commands.Commands = ()
    if word in checkout_commands.WORDS:
        try:
            from_checkout = checkout_commands.load(word)
        except checkout_commands.NoCheckout as exc:
            print(f"rfork: error: {exc}", file=sys.stderr)
            return 1
    parser = build_parser(from_checkout)
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in ("demo", "bench"):
        # start-up: the demo and the benchmarks talk only to processes they start themselves, so they
        # may register read-only regions on shm where libfabric does not enforce access (1.17;
        # backends.providers.libfabric.ALLOW_UNENFORCED_ENV, docs/transport.md). `rfork seed` may not.
        os.environ.setdefault("RFORK_ALLOW_UNENFORCED_ACCESS", "1")
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI's last word: one line, not a traceback
        if args.debug:
            raise
        torch_missing = isinstance(exc, ModuleNotFoundError) and exc.name == "torch"
        print(f"rfork: error: {NEEDS_TORCH if torch_missing else exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
