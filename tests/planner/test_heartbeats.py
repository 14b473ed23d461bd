"""Coalesced heartbeats: many at once are one UPDATE, each caller still gets its own status or 404."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from planner.contract import NotFound, PlannerClient
from tests.planner.conftest import identity


def test_concurrent_heartbeats_each_get_their_status(server):
    c = PlannerClient(server.url)
    ids = [c.register_instance(identity=identity()).id for _ in range(6)]
    c.set_status(ids[0], "READY")
    before = time.time()

    def beat(i: int) -> str:
        return PlannerClient(server.url).heartbeat(ids[i % len(ids)]).status.value

    with ThreadPoolExecutor(24) as pool:
        got = list(pool.map(beat, range(48)))
    assert got == ["READY" if i % len(ids) == 0 else "INITIALIZING" for i in range(48)]
    for iid in ids:
        assert c.get_instance(iid).last_heartbeat >= before
    with pytest.raises(NotFound):
        c.heartbeat("f" * 32)
    text = httpx.get(server.url + "/metrics").text
    assert 'route="/v1/instances/{instance_id}/heartbeat"' in text  # the fast path is counted
