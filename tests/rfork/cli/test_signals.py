"""SIGINT and SIGTERM during a disk read of `rfork load` without a planner: real processes, each
signalled on the event that its (slow, test-double) disk read has begun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.rfork.cli.slow_disk import READING

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]


def _load_signalled_mid_read(checkpoint: Path, signum: int) -> tuple[int, str, float]:
    """(status, stderr, seconds from the signal to the exit) of one `rfork load` signalled mid-read."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RFORK_PLANNER_URL", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.rfork.cli.slow_disk",
            "load",
            "--checkpoint",
            str(checkpoint),
            "--no-serve",
            "--no-progress",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.strip() == READING:
                break
        else:
            raise AssertionError(f"the load ended before reading: {''.join(lines)}")
        t0 = time.monotonic()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
        return proc.returncode, "".join(lines) + err, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_a_disk_read_without_a_planner_exits_128_plus_it(signum, medium_ckpt):
    """Three times each: 130/143 and one error line within a few seconds (the reads in flight end;
    the queued ones are dropped), never status 1 with nothing said from a library's own handler."""
    name = signal.Signals(signum).name
    for _ in range(3):
        status, err, seconds = _load_signalled_mid_read(medium_ckpt, signum)
        assert status == 128 + signum, err
        errors = [ln for ln in err.splitlines() if ln.startswith("rfork: error:")]
        assert errors == [
            f"rfork: error: interrupted by {name}: the load stopped; no lease is held and nothing is served"
        ], err
        assert "Traceback" not in err
        assert seconds < 8, seconds  # the ~240 queued reads of 1 s on 8 threads would take ~30 s more
