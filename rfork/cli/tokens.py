"""Planner tokens for the CLI: from a file or the environment (`$RFORK_X`, or the file `$RFORK_X_FILE`
names), never from argv (which every user of the host can read in `ps` and /proc/PID/cmdline)."""

from __future__ import annotations

import argparse
from pathlib import Path

from planner import warn_if_world_readable
from rfork.env_secrets import env_secret
from rfork.errors import ConfigurationError


def add_token_file(parser: argparse.ArgumentParser, flag: str, *, env: tuple[str, ...], role: str) -> None:
    """`flag` PATH: read the token with `role` from that file (default: the first of `env`, or of their
    `_FILE` forms, that is set)."""
    names = ", ".join(f"${n} or ${n}_FILE" for n in env)
    parser.add_argument(
        flag,
        type=Path,
        default=None,
        metavar="PATH",
        help=f"file holding the planner token with the {role} role (default: {names})",
    )


def read_token(path: Path | None, *, env: tuple[str, ...]) -> str | None:
    """The token in `path` (surrounding whitespace stripped), else the first of `env` that is set
    (each as `$NAME` or `$NAME_FILE`, rfork.env_secrets)."""
    if path is not None:
        warn_if_world_readable(str(path), "--token-file")
        try:
            token = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            problem = exc.strerror or exc
            raise ConfigurationError(f"token file {path}: {problem}", setting="token_file") from exc
        if not token:
            raise ConfigurationError(f"token file {path} is empty", setting="token_file")
        return token
    for name in env:
        found = env_secret(name)
        if found:
            return found
    return None
