"""`rfork bench moe` as a user runs it, at a tiny size: a table, JSON without NaN, equal outputs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest


def _no_nan(value: str) -> float:
    raise AssertionError(f"JSON holds {value}")


@pytest.mark.slow
def test_bench_moe_small_run_writes_rows_and_ratios(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rfork",
            "bench",
            "moe",
            "--ranks",
            "2",
            "--tokens",
            "8",
            "--hidden",
            "32",
            "--topk",
            "2",
            "--experts",
            "4",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--provider",
            "shm",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "gloo" in proc.stdout
    doc = json.loads(out.read_text(), parse_constant=_no_nan)
    assert doc["outputs_equal"] is True
    assert {(r["provider"], r["phase"]) for r in doc["rows"]} == {
        ("shm", ph) for ph in ("dispatch", "combine")
    }
    for row in doc["rows"]:
        assert 0 < row["rfork_p50_us"] <= row["rfork_p99_us"]
        assert 0 < row["gloo_p50_us"] <= row["gloo_p99_us"]
        assert math.isclose(row["ratio_p50"], row["rfork_p50_us"] / row["gloo_p50_us"], rel_tol=0.01)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ranks", "1"], "--ranks must be >= 2"),
        (["--provider", "efa"], "--provider must list shm and/or tcp"),
        (["--topk", "9", "--experts", "8"], "--topk must be between 1 and --experts"),
    ],
)
def test_bench_moe_bad_options_are_one_line_errors(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rfork", "bench", "moe", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
