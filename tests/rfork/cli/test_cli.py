"""The `rfork` entry point as a user meets it: a real subprocess, its exit status and output."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rfork import __version__


def rfork(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rfork", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_version_matches_package_metadata() -> None:
    out = rfork("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"rfork {__version__}"
    assert __version__ != "0.0.0+unknown", "the package must be installed (pip install -e .)"


@pytest.mark.parametrize(
    "path",
    [
        (),
        ("planner",),
        ("planner", "serve"),
        ("planner", "migrate"),
        ("seed",),
        ("load",),
        ("demo",),
        ("bench",),
        ("bench", "transport"),
        ("bench", "cold-start"),
        ("bench", "planner"),
        ("bench", "gpu"),
        ("bench", "moe"),
    ],
)
def test_every_command_has_help(path: tuple[str, ...]) -> None:
    out = rfork(*path, "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: rfork" in out.stdout


def test_unknown_command_is_a_one_line_error_with_nonzero_status() -> None:
    out = rfork("no-such-command")
    assert out.returncode == 2
    assert "invalid choice" in out.stderr
    assert "Traceback" not in out.stderr
