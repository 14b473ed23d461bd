"""rfork demo: the main job end to end on embedded defaults, cleaning up after itself."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.rfork_cli import run_rfork

pytestmark = pytest.mark.slow


def test_demo_runs_and_cleans_up(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    out = tmp_path / "demo.json"
    before = set(Path("/tmp").glob("rfork-demo-*"))
    status, stdout, stderr = run_rfork(
        ["demo", "--size-gib", "0.03", "--provider", "tcp", "--no-nccl", "--no-fleet", "--json", str(out)],
        capsys,
    )
    assert status == 0, stdout + stderr
    doc = json.loads(out.read_text())
    rows = {r["row"]: r for r in doc["rows"]}
    # an engine's start-up per source: disk (cold where the page cache can be dropped, and warm),
    # Run:ai where installed, R-Fork over tcp, and from an R-Forked instance (chain)
    assert {"disk (warm)", "rfork-tcp", "chain"} <= set(rows)
    assert ("disk (cold)" in rows) == (os.geteuid() == 0)
    assert not rows["disk (warm)"]["verified"]  # disk has nothing to compare
    assert rows["rfork-tcp"]["verified"]
    assert rows["chain"]["verified"]
    assert doc["model_bytes"] > 0
    assert "speed-up" in stdout
    assert set(Path("/tmp").glob("rfork-demo-*")) == before
