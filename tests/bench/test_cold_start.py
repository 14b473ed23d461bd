"""`rfork bench cold-start` end to end on a small checkpoint: real planner, seed and loader processes.

Asserts what the table claims, not its speed: the pulled rows verified and came from the source they
name, the disk row says it compared nothing, and the baselines were measured in the run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.rfork_cli import run_rfork

pytestmark = pytest.mark.slow  # spawned processes: runs in the slow part of scripts/dev.sh test


@pytest.mark.parametrize("dest", ["allocated", "initialized"])
def test_cold_start_rows_and_baselines(tmp_path: Path, dest: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cold.json"
    args = ["bench", "cold-start", "--size-gib", "0.03", "--repeat", "1"]
    args += ["--dest", dest, "--sources", "disk", "rfork-tcp", "--settle-s", "0.2", "--json", str(out)]
    status, stdout, stderr = run_rfork(args, capsys)
    assert status == 0, stdout[-3000:] + stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["dest"] == dest
    rows = {r["source"]: r for r in doc["rows"]}
    assert set(rows) == {"disk", "rfork-tcp"}
    pulled, disk = rows["rfork-tcp"], rows["disk"]
    assert pulled["verified"] is True
    assert pulled["actual_sources"] == ["rfork-tcp"]
    assert disk["verified"] is False
    assert disk["actual_sources"] == ["disk"]
    assert pulled["transport_gb_per_s"] > 0
    assert pulled["pull_efficiency"] > 0
    assert pulled["phases"]["transfer"] > 0
    # the first touch of the destination is shown: pre-faulting it, and the reads' wait for that
    assert pulled["phases"]["prefault"] >= 0
    assert 0 <= pulled["phases"]["prefault_wait"] <= pulled["phases"]["transfer"]
    # the transport baseline reads a working set as large as the model (to the 8 MiB read size)
    assert doc["model_bytes"] - (8 << 20) < doc["transport_working_set_bytes"] <= doc["model_bytes"]
    if dest == "allocated":
        assert doc["settle_s"] == 0.2  # every fresh-memory process started from the same memory state
        assert pulled["phases"]["prefault"] > 0  # the loader's own buffers are fresh: faulted in
        assert len(doc["fresh_memcpy_runs_s"]) == 1
        assert doc["memcpy_s"] == doc["fresh_memcpy_runs_s"][0]
    else:
        assert doc["settle_s"] == 0  # the framework touched its tensors before the timed fill
        assert doc["fresh_memcpy_runs_s"] == []
        assert doc["memcpy_s"] == doc["memcpy_touched_s"]
