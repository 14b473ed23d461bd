"""`rfork bench rollout`: a tiny run against a seed process reads only the changed tensors' bytes, verified
and equal to the new version, while the full pull reads them all."""

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
    assert rows["full"]["bytes"] == doc["model_bytes"]
    for row in ("rollout", "rollout, held digests"):
        assert rows[row]["verified"] is True
        assert rows[row]["bytes"] == doc["bytes_changed"] < doc["model_bytes"]
