"""`rfork bench rl-delta`: a tiny run in real processes writes every figure, verified, and a step at a
small learning rate goes as a delta while one that changes most values goes whole."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import rl_delta

pytestmark = pytest.mark.slow  # spawned processes: runs in the slow part of scripts/dev.sh test


def test_a_tiny_run_sends_small_steps_as_deltas_and_verifies(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    rl_delta.configure(parser)
    out = tmp_path / "rl-delta.json"
    argv = ["--size-gib", "0.01", "--repeat", "1", "--lr", "1e-6", "1e-3", "--json", str(out)]
    args = parser.parse_args(argv)
    assert rl_delta.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["verified"] is True
    small, large = doc["rows"]
    assert small["as_delta"] is True
    assert small["bytes_of_full"] < 0.1
    assert large["as_delta"] is False
    assert large["bytes_of_full"] == 1.0
    assert doc["full_update_s"] > 0
    assert doc["gloo_broadcast_s"] > 0
