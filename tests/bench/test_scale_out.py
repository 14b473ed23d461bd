"""rfork bench scale-out: a real burst of loader processes against one seed."""

from __future__ import annotations

import json

import pytest

from bench.scale_out import max_concurrent
from tests.rfork_cli import run_rfork


def test_max_concurrent_counts_overlaps_only():
    assert max_concurrent([(0, 1), (1, 2), (2, 3)]) == 1
    assert max_concurrent([(0, 3), (1, 2), (1.5, 4)]) == 3
    assert max_concurrent([]) == 0


@pytest.mark.slow
def test_bench_burst_of_six_loaders_against_one_seed_with_limit_two(tmp_path, capsys):
    """One seed (limit 2), then six `rfork load` processes at once: all verified, no seed over its limit."""
    out = tmp_path / "burst.json"
    status, _, stderr = run_rfork(
        ["bench", "scale-out", "--instances", "6", "--size-gib", "0.02",
         "--max-concurrent-pulls", "2", "--modes", "tree", "disk", "--json", str(out), "--timeout", "600"],
        capsys,
    )  # fmt: skip
    assert status == 0, stderr[-3000:]
    doc = json.loads(out.read_text())
    tree = doc["modes"]["tree"]
    assert tree["instances"] == 6
    assert tree["verified"]
    assert tree["sources"] == {"rfork-tcp": 6}
    assert tree["within_limit"]
    assert max(tree["max_pulls_per_seed"].values()) <= 2
    assert tree["max_pulls_per_seed"]["seed"] >= 1
    names = {t["loader"] for t in tree["tree"]}
    for edge in tree["tree"]:
        assert edge["from"] == "seed" or edge["from"] in names - {edge["loader"]}
    disk = doc["modes"]["disk"]
    assert disk["sources"] == {"disk": 6}  # (a plain disk load compares no digests: verified is false)
    assert doc["load_average"]
