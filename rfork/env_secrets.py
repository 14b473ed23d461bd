"""Secrets from the environment: `$NAME`, or the file `$NAME_FILE` names (a mounted Kubernetes or Docker
secret), so that a token need not sit in the process environment or on a command line."""

from __future__ import annotations

import os
from collections.abc import Mapping

from rfork.errors import ConfigurationError


class SecretFileError(ConfigurationError):
    """A `*_FILE` variable names a file that cannot be read or is empty, or both forms are set;
    `setting` is the variable's name."""


def env_secret(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """`$name` if set, else the contents (surrounding whitespace stripped) of the file `$name_FILE`
    names, else None. SecretFileError when both are set or the file is unreadable or empty."""
    env = os.environ if environ is None else environ
    value = env.get(name) or None
    path = env.get(f"{name}_FILE") or None
    if path is None:
        return value
    if value is not None:
        raise SecretFileError(f"both ${name} and ${name}_FILE are set; keep one", setting=name)
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise SecretFileError(f"${name}_FILE={path}: {exc.strerror or exc}", setting=name) from exc
    # imported here: vLLM's plugin load (start-up) imports this module and must load no planner module
    from planner import warn_if_world_readable

    warn_if_world_readable(path, f"${name}_FILE")
    if not secret:
        raise SecretFileError(f"${name}_FILE={path} is empty", setting=name)
    return secret
