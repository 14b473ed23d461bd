"""`rfork digest CHECKPOINT`: the digests an admin uploads as the identity's anchor (issue #21)."""

from __future__ import annotations

import json

import httpx

from planner import PlannerServer
from rfork.seed.seed import Seed
from rfork.weights.checkpoint import load_rank_from_disk, read_checkpoint_info
from rfork.weights.rank_weights import RankWeights
from tests.rfork.conftest import ADMIN, LOAD, REGISTER
from tests.rfork_cli import run_rfork


def test_uploaded_digests_anchor_the_identity_a_seed_then_serves(small_ckpt, sqlite_url, tmp_path, capsys):
    out = tmp_path / "anchors.json"
    status, _, err = run_rfork(["digest", "--checkpoint", str(small_ckpt), "--out", str(out)], capsys)
    assert status == 0, err
    bodies = json.loads(out.read_text())
    assert [b["rank"] for b in bodies] == [0]
    info = read_checkpoint_info(small_ckpt)
    with PlannerServer(
        db_url=sqlite_url, admin_token=ADMIN, register_token=REGISTER, load_token=LOAD, reaper_interval_s=3600
    ) as srv:
        for body in bodies:  # what an operator does: PUT each rank's digests as admin
            r = httpx.put(srv.url + "/v1/anchors", json=body, headers={"Authorization": f"Bearer {ADMIN}"})
            assert r.status_code == 200, r.text
        layout, buffers, tensors = load_rank_from_disk(info)
        weights = RankWeights(rank=0, layout=layout, buffers=buffers, tensors=tensors)
        # a seed with the register role only (it cannot anchor) is served: it matches the upload
        with Seed(
            weights=[weights], identity=info.identity(), planner_url=srv.url, control=False, token=REGISTER
        ):
            lease = httpx.post(
                srv.url + "/v1/assignments",
                json={"identity": info.identity().model_dump(), "rank": 0, "providers": ["tcp"]},
                headers={"Authorization": f"Bearer {LOAD}"},
            )
            assert lease.status_code == 201, lease.text
