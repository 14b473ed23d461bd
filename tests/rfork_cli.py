"""`rfork ARGS` in the test's own process, for the tests of rfork's commands and of bench/'s.

Not in tests/conftest.py: that one is loaded for every test package, and the planner's and the
transport's tests must run without rfork.
"""

from __future__ import annotations

import pytest

from rfork.cli import main as rfork_main


def run_rfork(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`rfork ARGS` in this process (the CLI's own code path, without a fresh interpreter's start-up):
    (exit status, stdout, stderr)."""
    status = rfork_main(args)
    out, err = capsys.readouterr()
    return status, out, err
