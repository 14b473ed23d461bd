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



def test_demo_allows_read_only_regions_on_unenforcing_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    """`rfork demo` (and `bench`) talk only to processes they start, so they set the allowance."""
    import os

    from rfork.cli import main

    monkeypatch.delenv("RFORK_ALLOW_UNENFORCED_ACCESS", raising=False)
    assert main(["demo", "--size-gib", "0"]) == 1  # refused at once, before any process starts
    assert os.environ.get("RFORK_ALLOW_UNENFORCED_ACCESS") == "1"
