"""rack_hold (load_aware): a requester whose rack holds a seed of the identity waits for it rather than
pull across racks; a rack without one still gets its first copy from elsewhere."""

from __future__ import annotations

import json

import pytest

from planner import AllBusy, RegistrationRequest
from tests.planner.conftest import identity, make_planner, manifest, ranks
from tests.planner.test_burst import _ask


def _seed(svc, now: float, rack: str, *, limit: int = 1) -> str:
    body = RegistrationRequest.model_validate(
        {
            "identity": identity(),
            "labels": {"node": f"seed-{rack}", "rack": rack, "zone": "z"},
            "ranks": [{**r, "address": "YWRkcg=="} for r in ranks(0, 1)],
            "max_concurrent_pulls": limit,
        }
    )
    iid = svc.register(body, now).id
    svc.put_manifest(iid, 0, json.dumps(manifest(0)), now)
    svc.set_status(iid, "READY", now)
    return iid


def _in(rack: str, node: str = "n1"):
    return _ask(labels={"node": node, "rack": rack, "zone": "z"})


@pytest.mark.parametrize("hold", [True, False])
def test_a_rack_with_a_busy_seed_waits_for_it_only_under_rack_hold(planner_url, hold):
    svc = make_planner(planner_url, rack_hold=hold)
    try:
        now = 1000.0
        near = _seed(svc, now, "r1")
        far = _seed(svc, now, "r2", limit=2)
        assert svc.assign(_in("r1"), now).candidates[0].instance_id == near  # its own rack first
        if hold:
            with pytest.raises(AllBusy):  # r1's seed is busy: wait for it, not the free one in r2
                svc.assign(_in("r1", "n2"), now)
        else:
            assert svc.assign(_in("r1", "n2"), now).candidates[0].instance_id == far
        # a rack without a seed crosses racks for its first copy either way
        assert svc.assign(_in("r3"), now).candidates[0].instance_id == far
    finally:
        svc.close()


def test_rack_hold_ignores_a_rack_seed_the_requester_excludes(planner_url):
    svc = make_planner(planner_url, rack_hold=True)
    try:
        now = 1000.0
        near = _seed(svc, now, "r1")
        far = _seed(svc, now, "r2")
        svc.assign(_in("r1"), now)
        got = svc.assign(_ask(labels={"node": "n2", "rack": "r1", "zone": "z"}, exclude=[near]), now)
        assert got.candidates[0].instance_id == far
    finally:
        svc.close()
