"""The `rfork` command line: one entry point, one module per command.

Each command module has `configure(parser)` and `run(args) -> int` and keeps its top-level imports
light (no torch, no FastAPI, no transport): every one of them is imported here, so `rfork --help`
stays instant. They import what they need inside `run`, with a comment saying so. `rfork demo`,
`rfork bench ...` and `rfork simulate ...` run from a source checkout (rfork/cli/checkout_commands.py).

The global options (-v, -q, --debug, --log-format) go anywhere before a `--`. Errors end in one line
and a status: 2 for a wrong setting (rfork.ConfigurationError, and argparse's usage errors), 1 for
any other failure, 128 + the signal for SIGINT (130) and SIGTERM (143) during a load.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from rfork import __version__
from rfork.cli import (
    anchor,
    checkout_commands,
    digest,
    fleet,
    load,
    logs,
    planner_migrate,
    planner_serve,
    seed,
    sglang,
    vllm,
)
from rfork.cli.options import DEPRECATED, HelpFormatter, deprecated_used
from rfork.errors import NEEDS_TORCH, ConfigurationError, Interrupted

# (command path, implementing module). Groups ("planner") are created on the way. `rfork demo`,
# `rfork bench ...` and `rfork simulate ...` come from the checkout's bench/ (checkout_commands.py).
COMMANDS: checkout_commands.Commands = (
    (("planner", "serve"), planner_serve),
    (("planner", "migrate"), planner_migrate),
    (("seed",), seed),
    (("load",), load),
    (("digest",), digest),
    (("anchor",), anchor),
    (("fleet",), fleet),
    (("sglang",), sglang),
    (("vllm",), vllm),
)

GROUP_HELP = {"planner": "run or migrate the planner service", **checkout_commands.WORDS}

log = logging.getLogger("rfork")


def _summary(module: ModuleType) -> str:
    doc = (module.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""


def _global_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """-v, -q, --debug, --log-format; on every parser, so that they go anywhere on the command line.
    A command's own copies write `sub_*` (merged in `_merge_globals`), unset unless given."""
    group = parser.add_argument_group("global options (anywhere before --)")
    keep: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    prefix = "" if top else "sub_"
    group.add_argument(
        "-v",
        "--verbose",
        action="count",
        dest=f"{prefix}verbose",
        **({"default": 0} if top else keep),
        help="debug output from rfork (-vv: from every library too)",
    )
    group.add_argument(
        "-q", "--quiet", action="store_true", dest=f"{prefix}quiet", **keep, help="warnings and errors only"
    )
    group.add_argument(
        "--debug", action="store_true", dest=f"{prefix}debug", **keep, help="show tracebacks on errors"
    )
    group.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        dest=f"{prefix}log_format",
        **({"default": os.environ.get("RFORK_LOG_FORMAT") or "text"} if top else keep),
        help="text, or json: one object per line (default: $RFORK_LOG_FORMAT, else text)",
    )


def _merge_globals(args: argparse.Namespace) -> None:
    """Fold the command-level copies of the global options into the top-level ones."""
    args.verbose += getattr(args, "sub_verbose", 0)
    args.quiet = args.quiet or getattr(args, "sub_quiet", False)
    args.debug = args.debug or getattr(args, "sub_debug", False)
    args.log_format = getattr(args, "sub_log_format", args.log_format)


def build_parser(from_checkout: checkout_commands.Commands = ()) -> argparse.ArgumentParser:
    """The whole command tree; each leaf parser carries its module in `_module`.

    Without `from_checkout` (checkout_commands.load()), `demo`, `bench` and `simulate` are listed with
    their help only: `rfork --help` does not import bench/.
    """
    parser = argparse.ArgumentParser(
        prog="rfork",
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rfork {__version__}")
    _global_options(parser, top=True)
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]] = {}
    for path, module in (*COMMANDS, *from_checkout):
        subs = top
        for i, word in enumerate(path[:-1]):
            key = " ".join(path[: i + 1])
            if key not in groups:
                group = subs.add_parser(
                    word,
                    help=GROUP_HELP.get(word),
                    description=GROUP_HELP.get(word),
                    formatter_class=HelpFormatter,
                )
                groups[key] = group.add_subparsers(dest=f"{word}_command", metavar="COMMAND", required=True)
            subs = groups[key]
        summary = _summary(module)
        # no abbreviations: `--token` must be refused, not read as `--token-file`
        leaf = subs.add_parser(
            path[-1],
            help=summary,
            description=getattr(module, "DESCRIPTION", summary),
            allow_abbrev=False,
            formatter_class=HelpFormatter,
        )
        module.configure(leaf)
        _global_options(leaf, top=False)
        leaf.set_defaults(_module=module)
    loaded = {path[0] for path, _ in from_checkout}
    for word, text in checkout_commands.WORDS.items():
        if word not in loaded:
            top.add_parser(word, help=text, description=text)
    return parser


# a setting a ConfigurationError names -> what to change, for commands that do not say it themselves
FIXES = {
    "planner_url": "fix --planner (or $RFORK_PLANNER_URL)",
    "providers": "fix --provider (or $RFORK_PROVIDERS)",
    "token": "check the token (--token-file, or the variable the command's --help names)",
    "register_token": "give a token with the register role (--register-token-file or $RFORK_REGISTER_TOKEN), "
    "or --no-serve",
    "protocol": "run rfork releases of one wire protocol (docs/operations.md)",
    "request": "check the identity and options given",
}


def _command_word(argv: Sequence[str]) -> str | None:
    """The first word of the command (skipping the global options and the value of --log-format)."""
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word == "--log-format":
            skip = True
        elif not word.startswith("-"):
            return word
    return None


def _error(args: argparse.Namespace | None, message: str) -> None:
    """The CLI's last word: one line on stderr (a JSON record with --log-format json)."""
    if args is not None and getattr(args, "log_format", "text") == "json":
        log.error("%s", message)
    else:
        print(f"rfork: error: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (non-zero with a one-line error on failure)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    word = _command_word(argv)
    from_checkout: checkout_commands.Commands = ()
    if word in checkout_commands.WORDS:
        try:
            from_checkout = checkout_commands.load(word)
        except checkout_commands.NoCheckout as exc:
            print(f"rfork: error: {exc}", file=sys.stderr)
            return 1
    parser = build_parser(from_checkout)
    args = parser.parse_args(argv)
    _merge_globals(args)
    logs.setup_logging(verbose=args.verbose, quiet=args.quiet, fmt=args.log_format)
    for old in deprecated_used(argv):
        log.warning("%s is now %s; the old spelling goes in the next release", old, DEPRECATED[old])
    if args.command in ("demo", "bench"):
        # start-up: the demo and the benchmarks talk only to processes they start themselves, so they
        # may register read-only regions on shm where libfabric does not enforce access (1.17;
        # backends.providers.libfabric.ALLOW_UNENFORCED_ENV, docs/transport.md). `rfork seed` may not.
        os.environ.setdefault("RFORK_ALLOW_UNENFORCED_ACCESS", "1")
    try:
        return _run(args, from_checkout=word in checkout_commands.WORDS)
    except Interrupted as exc:
        _error(
            args,
            f"interrupted by {_signal_name(exc.signum)}: {getattr(args._module, 'INTERRUPTED', 'stopped')}",
        )
        return 128 + exc.signum
    except KeyboardInterrupt:
        return 130
    except ConfigurationError as exc:
        if args.debug:
            raise
        fixes = {**FIXES, **getattr(args._module, "FIXES", {})}
        fix = fixes.get(exc.setting)
        _error(args, f"{exc}" + (f" ({fix})" if fix and fix not in str(exc) else ""))
        return 2
    except Exception as exc:  # noqa: BLE001 - the CLI's last word: one line, not a traceback
        if args.debug:
            raise
        torch_missing = isinstance(exc, ModuleNotFoundError) and exc.name == "torch"
        _error(args, NEEDS_TORCH if torch_missing else _one_line(exc))
        return 1


def _run(args: argparse.Namespace, *, from_checkout: bool) -> int:
    """The command; a benchmark or simulation runs under a progress bar (elapsed time, log lines above
    it) unless it draws its own, and its tables get the full width where stdout is not a terminal."""
    if not from_checkout:
        return int(args._module.run(args) or 0)
    if not sys.stdout.isatty():
        os.environ.setdefault("COLUMNS", "200")  # rich tables: not cut to 80 columns in a file or pipe
    if getattr(args._module, "OWN_PROGRESS", False):
        return int(args._module.run(args) or 0)
    words = [args.command, *(getattr(args, f"{args.command}_command", None) or "").split()]
    with logs.progress_bar(f"rfork {' '.join(w for w in words if w)}", unit="none"):
        return int(args._module.run(args) or 0)


def _signal_name(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _one_line(exc: BaseException) -> str:
    """`exc`'s message on one line (a database driver's message runs over several)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 500 else text[:497] + "..."


if __name__ == "__main__":
    sys.exit(main())
