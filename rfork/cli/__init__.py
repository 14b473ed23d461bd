"""The `rfork` command line: one entry point, one module per command.

Each command module has `configure(parser)` and `run(args) -> int` and keeps its top-level imports
light (no torch, no FastAPI, no transport): every one of them is imported here, so `rfork --help`
stays instant. They import what they need inside `run`, with a comment saying so.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from rfork import __version__
from rfork.bench import api_ready as bench_api_ready
from rfork.bench import cold_start as bench_cold_start
from rfork.bench import digest as bench_digest
from rfork.bench import gpu as bench_gpu
from rfork.bench import kv as bench_kv
from rfork.bench import moe as bench_moe
from rfork.bench import nccl as bench_nccl
from rfork.bench import planner as bench_planner
from rfork.bench import rl as bench_rl
from rfork.bench import scale_out as bench_scale_out
from rfork.bench import transport as bench_transport
from rfork.cli import demo, digest, load, planner_migrate, planner_serve, seed, sglang, vllm
from rfork.simulate import scale_out as simulate_scale_out

# (command path, implementing module). Groups ("planner", "bench") are created on the way.
COMMANDS: tuple[tuple[tuple[str, ...], ModuleType], ...] = (
    (("planner", "serve"), planner_serve),
    (("planner", "migrate"), planner_migrate),
    (("seed",), seed),
    (("load",), load),
    (("demo",), demo),
    (("digest",), digest),
    (("sglang",), sglang),
    (("vllm",), vllm),
    (("bench", "transport"), bench_transport),
    (("bench", "cold-start"), bench_cold_start),
    (("bench", "planner"), bench_planner),
    (("bench", "gpu"), bench_gpu),
    (("bench", "rl"), bench_rl),
    (("bench", "moe"), bench_moe),
    (("bench", "kv"), bench_kv),
    (("bench", "nccl"), bench_nccl),
    (("bench", "scale-out"), bench_scale_out),
    (("bench", "digest"), bench_digest),
    (("bench", "api-ready"), bench_api_ready),
    (("simulate", "scale-out"), simulate_scale_out),
)

GROUP_HELP = {
    "planner": "run or migrate the planner service",
    "bench": "benchmarks; each measures its baseline in the same run and prints the ratio",
    "simulate": "simulations that drive the real planner on a bandwidth model",
}

log = logging.getLogger("rfork")


def _summary(module: ModuleType) -> str:
    doc = (module.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree; each leaf parser carries its module in `_module`."""
    parser = argparse.ArgumentParser(prog="rfork", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"rfork {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]] = {}
    for path, module in COMMANDS:
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (non-zero with a one-line error on failure)."""
    parser = build_parser()
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
        print(f"rfork: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
