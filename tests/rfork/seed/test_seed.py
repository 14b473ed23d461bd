"""rfork.seed.seed: serving in place costs no copy of the weights, and a loader pulls from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rfork import pull_into
from rfork.identity import SourceIdentity
from tests.rfork.conftest import AUTH, opts

RSS_CHILD = textwrap.dedent(
    """
    import json, os, sys, torch
    from planner.contract import PlannerClient  # imported before the baseline: not part of serving
    from rfork.identity import SourceIdentity
    from backends import TransferEngine
    from rfork.seed.seed import RankServer, Seed
    from rfork.weights.rank_weights import RankWeights

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    nbytes = int(sys.argv[2])
    tensors = {f"layer{i}.weight": torch.full((nbytes // 8 // 4,), float(i)) for i in range(8)}
    server = RankServer(engine=TransferEngine("tcp", timeout_s=10.0))
    before = rss()
    weights = RankWeights.from_tensors(tensors=tensors)
    server.serve(weights)
    ident = SourceIdentity(model="rss", revision="r", dtype="float32", fingerprint="f" * 64)
    seed = Seed(weights=[weights], identity=ident, planner_url=sys.argv[1], servers=[server], control=False,
                token=os.environ["RFORK_REGISTER_TOKEN"])
    seed.start()
    after = rss()
    total = sum(t.numel() * 4 for t in tensors.values())
    print(json.dumps({"before": before, "after": after, "weights": total}), flush=True)
    sys.stdin.readline()  # serve until the parent has pulled
    seed.close()
    """
)


@pytest.mark.slow
def test_seed_process_serves_in_place_adding_at_most_one_percent_rss_and_a_loader_pulls_it(planner):
    # 1 GiB, so that the fixed cost of publishing (planner client, heartbeat and publish threads: about
    # 3-4 MiB whatever the model's size) stays under the 1% bound, while any copy of the weights would
    # exceed it a hundredfold
    nbytes = 1 << 30
    proc = subprocess.Popen(
        [sys.executable, "-c", RSS_CHILD, planner, str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RFORK_TCP_HOST": "127.0.0.1"},
        cwd=Path(__file__).resolve().parents[3],
    )
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        out = json.loads(proc.stdout.readline())
        assert out["weights"] == nbytes
        grew = out["after"] - out["before"]
        assert grew <= 0.01 * out["weights"], f"serving grew RSS by {grew} bytes for {nbytes} of weights"
        ident = SourceIdentity(model="rss", revision="r", dtype="float32", fingerprint="f" * 64)
        dest = {f"layer{i}.weight": torch.zeros(nbytes // 8 // 4) for i in range(8)}
        result = pull_into(
            identity=ident, planner_url=planner, tensors=dest, options=opts(become_seed=False), **AUTH
        )
        assert result.source == "rfork-tcp"
        assert result.verified
        assert all(bool((t == float(i)).all()) for i, t in enumerate(dest.values()))
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
