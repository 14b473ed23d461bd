"""rfork demo: the main job end to end on embedded defaults, cleaning up after itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.rfork_cli import run_rfork

pytestmark = pytest.mark.slow


def test_demo_runs_and_cleans_up(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    out = tmp_path / "demo.json"
    before = set(Path("/tmp").glob("rfork-demo-*"))
    status, stdout, stderr = run_rfork(
        ["demo", "--size-gib", "0.03", "--provider", "tcp", "--no-nccl"]
        + ["--settle-s", "0", "--json", str(out)],
        capsys,
    )
    assert status == 0, stdout + stderr
    doc = json.loads(out.read_text())
    sources = [r["source"] for r in doc["rows"]]
    assert sources[:2] == ["disk", "rfork-tcp"]
    assert len(sources) == 3
    assert doc["rows"][2].get("chain") is True
    assert [r["verified"] for r in doc["rows"]] == [False, True, True]  # disk has nothing to compare
    assert doc["model_bytes"] > 0
    assert doc["settle_s"] == 0
    assert "speed-up" in stdout
    assert set(Path("/tmp").glob("rfork-demo-*")) == before
