"""One vocabulary for every command: the options several commands share, spelled once, their
environment variables, and how help shows defaults.

- A concept has one flag name everywhere (`--model-name`, `--insecure`, `--no-serve`, `--provider`,
  `--repeat`, `--max-concurrent-pulls`). The old spellings in DEPRECATED still parse for one release,
  are left out of help, and `rfork` warns once when it meets one.
- An option with an environment variable names it in its help (`$RFORK_PLANNER_URL`), and the
  variable is its default; help shows every default.

Imported by `rfork --help`: the standard library only.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

# old spelling -> the one name now used for that concept (kept as a hidden alias for one release)
DEPRECATED = {
    "--insecure-ok": "--insecure",
    "--model": "--model-name",
    "--providers": "--provider",
    "--repeats": "--repeat",
    "--max-pulls": "--max-concurrent-pulls",
    "--then": "--no-serve",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help without the deprecated spellings, and with each option's default where its text does not
    already say it."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        shown = [s for s in action.option_strings if s not in DEPRECATED] or action.option_strings
        saved = action.option_strings
        action.option_strings = shown
        try:
            return super()._format_action_invocation(action)
        finally:
            action.option_strings = saved

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text.lower()
            or default in (None, False, argparse.SUPPRESS, [], ())
            or not action.option_strings
            or isinstance(action, argparse._HelpAction | argparse._VersionAction)
        ):
            return text
        return f"{text} (default: %(default)s)"


def deprecated_used(argv: Sequence[str]) -> list[str]:
    """The deprecated spellings in `argv` (before a `--`), each once, in order."""
    found: list[str] = []
    for word in argv:
        if word == "--":
            break
        name = word.split("=", 1)[0]
        if name in DEPRECATED and name not in found:
            found.append(name)
    return found


def env(name: str, default: str | None = None) -> str | None:
    """$name when set and not empty, else `default` (an option's default read from the environment)."""
    return os.environ.get(name) or default


def add_planner(parser: argparse.ArgumentParser, *, what: str = "planner base URL") -> None:
    """`--planner URL`, default $RFORK_PLANNER_URL."""
    parser.add_argument(
        "--planner",
        default=env("RFORK_PLANNER_URL"),
        metavar="URL",
        help=f"{what}, e.g. http://127.0.0.1:8470 (default: $RFORK_PLANNER_URL)",
    )


def add_provider(parser: argparse.ArgumentParser, *, what: str) -> None:
    """`--provider NAME` (repeat or comma-separate), default $RFORK_PROVIDERS or tcp."""
    parser.add_argument(
        "--provider",
        "--providers",
        dest="provider",
        action="append",
        default=None,
        metavar="NAME",
        help=f"{what}: tcp, shm, efa, verbs, auto (nccl: the two-sided fallback); repeat or "
        "comma-separate (default: $RFORK_PROVIDERS, else tcp)",
    )


def providers_of(values: Sequence[str] | None) -> list[str]:
    """The provider names given (flags, else $RFORK_PROVIDERS, else tcp), comma lists split."""
    given = list(values or [env("RFORK_PROVIDERS", "tcp") or "tcp"])
    return [p.strip() for v in given for p in v.split(",") if p.strip()]


def add_insecure(parser: argparse.ArgumentParser) -> None:
    """`--insecure`: talk to a planner that runs without auth (no token)."""
    parser.add_argument(
        "--insecure",
        "--insecure-ok",
        dest="insecure",
        action="store_true",
        help="the planner runs without auth (planner serve --insecure): send no token",
    )


def add_model_name(parser: argparse.ArgumentParser) -> None:
    """`--model-name NAME`: the model name in the identity."""
    parser.add_argument(
        "--model-name",
        "--model",
        dest="model_name",
        default=None,
        metavar="NAME",
        help="model name in the identity (default: config.json's _name_or_path, else the directory name)",
    )


def add_max_pulls(parser: argparse.ArgumentParser) -> None:
    """`--max-concurrent-pulls N`: the pull limit this instance publishes as a seed."""
    parser.add_argument(
        "--max-concurrent-pulls",
        "--max-pulls",
        dest="max_concurrent_pulls",
        type=int,
        default=2,
        metavar="N",
        help="pulls the planner may lease from this seed at once",
    )


def add_metrics(parser: argparse.ArgumentParser) -> None:
    """`--metrics-port PORT` and `--metrics-host HOST` (rfork.metrics)."""
    port = env("RFORK_METRICS_PORT")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(port) if port and port.isdigit() else None,
        metavar="PORT",
        help="serve Prometheus metrics on this port at /metrics (0: a free one; "
        "default: $RFORK_METRICS_PORT, else none)",
    )
    parser.add_argument(
        "--metrics-host",
        default=env("RFORK_METRICS_HOST", "127.0.0.1"),
        metavar="HOST",
        help="address the metrics port binds; 0.0.0.0 for a scraper on another host "
        "(default: $RFORK_METRICS_HOST, else 127.0.0.1)",
    )
