"""Long CLI work shows a rich progress bar on a terminal, with log lines printed above it."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow  # a fresh interpreter on a pseudo-terminal


def _on_a_terminal(*args: str, timeout_s: float = 120.0) -> tuple[int, str]:
    """`rfork ARGS` with stdout and stderr on a pseudo-terminal: (status, everything it drew)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rfork", *args],
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=follower,
        env={**os.environ, "COLUMNS": "120", "TERM": "xterm"},
    )
    os.close(follower)
    chunks = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.2)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(leader)
    return proc.wait(timeout=30), b"".join(chunks).decode(errors="replace")


def test_digest_draws_a_bar_with_its_log_lines_above(small_ckpt, tmp_path):
    # main: `rfork digest` drew nothing until it was done
    status, drawn = _on_a_terminal(
        "digest", "--checkpoint", str(small_ckpt), "--out", str(tmp_path / "a.json"), "-v"
    )
    assert status == 0, drawn
    assert "digesting" in drawn or "reading rank 0" in drawn
    assert "━" in drawn  # rich's bar
    assert "INFO rfork.digest: rank 0" in drawn  # log lines go through the same console
