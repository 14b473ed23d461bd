"""`rfork bench rollout`: a tiny run against seed processes of v1 and v2: a rollout reads only the changed
tensors' bytes from v2's seed (a new instance the rest from v1's), verified and equal to v2; a full
pull reads them all from v2's."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import rollout

pytestmark = pytest.mark.slow  # spawned processes: runs in the slow part of scripts/dev.sh test


def test_a_tiny_rollout_reads_only_the_changed_bytes(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    rollout.configure(parser)
    out = tmp_path / "rollout.json"
    args = parser.parse_args(["--size-gib", "0.02", "--repeat", "1", "--json", str(out)])
    assert rollout.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["equal"] is True
    rows = {r["row"]: r for r in doc["rows"]}
    assert all(r["verified"] for r in rows.values())
    assert rows["full"]["bytes"] == rows["full"]["from_v2"] == doc["model_bytes"]
    for row in ("rollout", "rollout, held digests"):
        assert rows[row]["bytes"] == rows[row]["from_v2"] == doc["bytes_changed"] < doc["model_bytes"]
    new = rows["new instance, rollout"]  # the rest came from the v1 seed
    assert new["bytes"] == doc["model_bytes"]
    assert new["from_v2"] == doc["bytes_changed"]
