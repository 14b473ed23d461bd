"""rack_hold (load_aware): a requester whose rack holds a seed of the identity waits for it rather than
pull across racks; a rack without one still gets its first copy from elsewhere."""

from __future__ import annotations

import json

import pytest

from planner import AllBusy, NoSource, RegistrationRequest, TransferReport
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


def test_a_rack_without_a_seed_takes_its_first_copy_once_and_its_other_loaders_wait_for_it(planner_url):
    # the emulated fleet (2 racks, uplink = one host NIC): every loader of the rack without a seed pulled
    # across the spine at once, and the shared uplink made the rack-aware tree 2x its ideal
    svc = make_planner(planner_url, rack_hold=True, rack_first_copies=1)
    try:
        now = 1000.0
        far = _seed(svc, now, "r0", limit=4)
        other = _seed(svc, now, "r0", limit=4)  # free while the first copy is pulled

        def serving(node: str, **over):
            return _ask(labels={"node": node, "rack": "r1", "zone": "z"}, serves_after=1, **over)

        first = svc.assign(serving("n1"), now)
        assert first.candidates[0].instance_id in (far, other)  # r1's first copy crosses the spine
        with pytest.raises(AllBusy):  # ... and the next r1 loader waits for it, though r0 has a free seed
            svc.assign(serving("n2"), now + 1)
        # once the first copy's pull failed, another r1 loader may bring the rack its first copy
        svc.report(first.id, TransferReport(outcome="failure", reason="transport"), now + 2)
        assert svc.assign(serving("n2", waited_s=1.0), now + 2).candidates[0].instance_id in (far, other)
    finally:
        svc.close()
    off = make_planner(planner_url, rack_hold=True, rack_first_copies=2)
    try:
        now = 2000.0
        _seed(off, now, "r9", limit=4)
        _seed(off, now, "r9", limit=4)  # (a loader that will serve pulls alone from a seed: two seeds)
        for node in ("m1", "m2"):  # two first copies allowed at once
            assert off.assign(_ask(labels={"node": node, "rack": "r8", "zone": "z"}, serves_after=1), now)
    finally:
        off.close()


def test_an_shm_seed_is_offered_only_to_a_loader_on_its_node(planner_url):
    svc = make_planner(planner_url)
    try:
        now = 1000.0
        body = RegistrationRequest.model_validate(
            {
                "identity": identity(),
                "labels": {"node": "host-a", "rack": "r1", "zone": "z"},
                "ranks": [
                    {**r, "address": "YWRkcg==", "provider": "shm", "backends": ["shm"]} for r in ranks(0, 1)
                ],
                "max_concurrent_pulls": 4,
            }
        )
        iid = svc.register(body, now).id
        svc.put_manifest(iid, 0, json.dumps(manifest(0)), now)
        svc.set_status(iid, "READY", now)

        def ask(node: str):
            return _ask(labels={"node": node, "rack": "r1", "zone": "z"}, providers=["shm"], backends=["shm"])

        assert svc.assign(ask("host-a"), now).candidates[0].provider == "shm"
        with pytest.raises(NoSource):
            svc.assign(ask("host-b"), now)
    finally:
        svc.close()
