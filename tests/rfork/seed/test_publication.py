"""rfork.seed.publication: topology labels, staying published through STALE, a forgetful planner and
an outage.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from bench.processes import free_port
from planner import PlannerServer
from planner.contract import PlannerClient
from rfork import load
from rfork.pull.options import BusyWait
from rfork.seed.seed import Seed
from rfork.weights.checkpoint import load_rank_from_disk, load_state_dict, read_checkpoint_info
from rfork.weights.rank_weights import RankWeights
from tests.rfork.conftest import ADMIN, AUTH, LOAD, READER, REGISTER, assert_same, opts
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
TOKENS: dict[str, Any] = {
    "admin_token": ADMIN,
    "register_token": REGISTER,
    "anchor_token": REGISTER,  # the tests' seeds load from disk on a trusted host: they anchor
    "load_token": LOAD,
    "reader_token": READER,
}


def _weights(ckpt) -> RankWeights:
    layout, buffers, tensors = load_rank_from_disk(read_checkpoint_info(ckpt))
    return RankWeights(rank=0, layout=layout, buffers=buffers, tensors=tensors)


def test_seed_reasserts_ready_after_stale_and_registers_again_after_404(small_ckpt, sqlite_url):
    info = read_checkpoint_info(small_ckpt)
    with PlannerServer(db_url=sqlite_url, heartbeat_ttl_s=1.5, reaper_interval_s=3600, **TOKENS) as srv:
        admin = PlannerClient(srv.url, token=ADMIN)
        with Seed(
            weights=[_weights(small_ckpt)],
            identity=info.identity(),
            planner_url=srv.url,
            control=False,
            token=REGISTER,
        ) as seed:
            first = seed.instance_ids[0]
            eng = create_engine(sqlite_url)
            with eng.begin() as conn:  # what the reaper does when heartbeats stopped for a while
                conn.execute(text("UPDATE instances SET status='STALE' WHERE id=:i"), {"i": first})
            eng.dispose()
            wait_until(lambda: admin.get_instance(first).status == "READY", 10, "READY again after STALE")
            admin.delete_instance(first)  # the planner forgets it (e.g. a fresh database)
            again = wait_until(lambda: [i for i in seed.instance_ids if i != first], 15, "re-registered")[0]
            assert admin.get_instance(again).status == "READY"
            result = load(
                identity=info.identity(), planner_url=srv.url, **AUTH, options=opts(become_seed=False)
            )
            assert result.attempts[0].instance_id == again
            assert result.source == "rfork-tcp"


def test_planner_down_during_load_keeps_weights_and_publishes_in_background(small_ckpt, sqlite_url):
    info = read_checkpoint_info(small_ckpt)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    # asks the unreachable planner for 1 s (default 30 s) before the disk: the outage is what is tested
    down = opts(busy_wait=BusyWait(planner_outage_s=1.0))
    result = load(identity=info.identity(), planner_url=url, checkpoint=small_ckpt, **AUTH, options=down)
    try:
        assert time.monotonic() - t0 < 60
        assert result.source == "disk"
        assert_same(result.state_dict(), load_state_dict(small_ckpt))
        assert result.seed is not None
        assert result.seed.instance_ids == []  # not published yet: the planner is down
        with PlannerServer(db_url=sqlite_url, port=port, **TOKENS) as srv:
            reader = PlannerClient(srv.url, token=READER)
            wait_until(lambda: reader.list_instances(status="READY").total == 1, 20, "published after outage")
            b = load(identity=info.identity(), planner_url=srv.url, **AUTH, options=opts(become_seed=False))
            assert b.source == "rfork-tcp"  # anchored by the disk-loaded instance, served from it
            assert b.attempts[0].instance_id == result.seed.instance_ids[0]
            assert_same(b.state_dict(), load_state_dict(small_ckpt))
    finally:
        result.close()
