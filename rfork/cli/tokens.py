"""Planner tokens for the CLI: from a file or the environment, never from argv (which every user of
the host can read in `ps` and /proc/PID/cmdline)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_token_file(parser: argparse.ArgumentParser, flag: str, *, env: tuple[str, ...], role: str) -> None:
    """`flag` PATH: read the token with `role` from that file (default: the first of `env` that is set)."""
    parser.add_argument(
        flag,
        type=Path,
        default=None,
        metavar="PATH",
        help=f"file holding the planner token with the {role} role (default ${', $'.join(env)})",
    )


def read_token(path: Path | None, *, env: tuple[str, ...]) -> str | None:
    """The token in `path` (surrounding whitespace stripped), else the first set variable of `env`."""
    if path is not None:
        try:
            token = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"token file {path}: {exc.strerror or exc}") from exc
        if not token:
            raise ValueError(f"token file {path} is empty")
        return token
    for name in env:
        if os.environ.get(name):
            return os.environ[name]
    return None
