"""Planner tokens for the CLI: from a file or the environment, never from argv (which every user of
the host can read in `ps` and /proc/PID/cmdline).

Each token variable also has a `_FILE` form (`RFORK_TOKEN_FILE=/run/secrets/rfork-load`): the path of
a file holding it, as Kubernetes and systemd mount secrets. A `--token-file` flag wins over both.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path


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


def read_token_file(path: Path, *, what: str) -> str:
    """The token in `path`, surrounding whitespace stripped; ValueError naming `what` when it cannot."""
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from exc
    if not token:
        raise ValueError(f"{what} {path} is empty")
    return token


def token_from_env(env: tuple[str, ...], environ: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """(token, where it came from) from the first of `env` that is set, each variable before its
    `_FILE` form; (None, "") when none is."""
    environ = os.environ if environ is None else environ
    for name in env:
        if environ.get(name):
            return environ[name], f"${name}"
        path = environ.get(f"{name}_FILE")
        if path:
            return read_token_file(Path(path), what=f"${name}_FILE"), f"${name}_FILE"
    return None, ""


def read_token(path: Path | None, *, env: tuple[str, ...]) -> str | None:
    """The token in `path` (the flag), else from the first set variable of `env` or its `_FILE` form."""
    if path is not None:
        return read_token_file(path, what="token file")
    return token_from_env(env)[0]
