"""Each candidate of an assignment says why it has its place: tier, load, the policy, rack hold.

The reason is an optional field of the wire's Candidate: a planner before it answers without one, and
a client before it ignores it (both checked here as the wire types decide).
"""

from __future__ import annotations

import pytest

from planner.contract import Assignment, CandidateReason, PlannerClient
from tests.planner.conftest import identity, make_planner
from tests.planner.routes.test_assignments import _seed as _http_seed
from tests.planner.test_rack_hold import _in, _seed


def test_each_candidate_carries_its_rank_reason(server):
    c = PlannerClient(server.url)
    near = _http_seed(c, node="n1", rack="r1", zone="z1", limit=2)
    far = _http_seed(c, node="n7", rack="r7", zone="z9", limit=2)
    first = c.request_assignment(
        identity=identity(), rank=0, labels={"node": "n2", "rack": "r1", "zone": "z1"}
    )
    assert first is not None
    by_id = {cand.instance_id: cand.reason for cand in first.candidates if cand.reason is not None}
    assert [cand.instance_id for cand in first.candidates] == [near, far]
    assert by_id[near] == CandidateReason(
        policy="load_aware",
        tier="rack",
        active_leases=0,
        max_concurrent_pulls=2,
        rack_hold=False,
        summary=by_id[near].summary,
    )
    assert by_id[far].tier == "elsewhere"
    assert "same rack" in by_id[near].summary
    assert "0/2 pulls busy" in by_id[near].summary
    assert "load_aware" in by_id[near].summary
    # the next decision sees the first lease on the nearest seed
    second = c.request_assignment(
        identity=identity(), rank=0, labels={"node": "n2", "rack": "r1", "zone": "z1"}
    )
    assert second is not None
    assert second.candidates[0].instance_id == near
    assert second.candidates[0].reason is not None
    assert second.candidates[0].reason.active_leases == 1


@pytest.mark.parametrize("hold", [True, False])
def test_rack_hold_is_named_in_the_reason(planner_url, hold):
    svc = make_planner(planner_url, rack_hold=hold)
    _seed(svc, 1.0, "r1")
    got = svc.assign(_in("r1", node="n5"), 2.0)
    (reason,) = [c.reason for c in got.candidates]
    assert reason is not None
    assert reason.rack_hold is hold
    assert ("rack hold: a seed in the requester's rack" in reason.summary) is hold
    svc.close()


def test_the_reason_is_optional_on_the_wire(server):
    c = PlannerClient(server.url)
    _http_seed(c)
    got = c.request_assignment(identity=identity(), rank=0)
    assert got is not None
    old_answer = got.model_dump(mode="json")
    for cand in old_answer["candidates"]:
        del cand["reason"]  # what a planner before the field sends
    assert Assignment.model_validate(old_answer).candidates[0].reason is None
    newer = got.model_dump(mode="json")
    newer["candidates"][0]["reason"]["something_new"] = 1  # a later planner's extra detail is ignored
    assert Assignment.model_validate(newer).candidates[0].reason == got.candidates[0].reason
