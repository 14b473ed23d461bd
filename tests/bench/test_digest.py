"""`rfork bench digest`: the interface scripts/gpu_check.sh calls (`--device cuda --sizes-gib 1 2 4 --json
FILE`), and one small CPU run whose figures and BLAKE3 agreement land in the JSON."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import digest


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    digest.configure(parser)
    return parser.parse_args(argv)


def test_the_gpu_check_interface_parses():
    args = _args("--device", "cuda", "--sizes-gib", "1", "2", "4", "--json", "out.json")
    assert (args.device, args.sizes_gib, args.json) == ("cuda", [1.0, 2.0, 4.0], Path("out.json"))
    out = subprocess.run(
        [sys.executable, "-m", "rfork", "bench", "digest", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--device" in out  # what gpu_check.sh looks for before it runs the section


def test_a_small_cpu_run_writes_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "digest.json"
    assert (
        digest.run(_args("--device", "cpu", "--sizes-gib", "0.001", "--repeat", "1", "--json", str(out))) == 0
    )
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["device_blake3_agrees"] == {"torch": True}
    assert set(row["gbps"]) == {*digest.HOST, "blake3 torch", "pmix64-v1"}  # triton: CUDA only
    assert all(v > 0 for v in row["gbps"].values())
    assert "blake3 torch" in capsys.readouterr().out


def test_too_small_a_size_is_refused():
    with pytest.raises(ValueError, match="sizes-gib"):
        digest.run(_args("--sizes-gib", "0.0000001"))
