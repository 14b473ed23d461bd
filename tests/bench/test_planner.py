"""`rfork bench planner` as a user runs it, at a tiny size."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_planner_bench_ignores_tokens_in_the_environment_and_writes_json_without_nan(tmp_path):
    """`rfork bench planner` starts its own --insecure server: an RFORK_ADMIN_TOKEN in the caller's
    environment used to turn auth on there while its clients sent none (every request a 401)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rfork",
            "bench",
            "planner",
            "--instances",
            "20",
            "--seconds",
            "2",
            "--clients",
            "2",
            "--heartbeaters",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RFORK_ADMIN_TOKEN": "set-by-the-operator"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    rows = {r["endpoint"]: r for r in data["rows"]}
    assert rows["register"]["count"] == 20
    assert rows["assignment"]["count"] > 0  # anchored seeds are served
