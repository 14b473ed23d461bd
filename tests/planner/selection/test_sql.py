"""The assignment's SQL-side selection against the whole-fleet ranking it replaced, on random fleets.

A decision reads only the free seeds of the best tiers (planner.queries, Planner._free_seeds); the
contract is the old one: rank every candidate seed (shared transport, not excluded) with the policy,
busy ones dropped, and lease the first `max_candidates`. Hypothesis builds fleets on both databases
(labels, limits, live/ended/expired leases, transports) and compares the two.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import insert

from planner import AllBusy, AssignmentRequest, NoSource, Planner, RankManifest, RegistrationRequest
from planner.models import Lease
from planner.selection import Requester, SeedView, choose_provider, make_policy
from tests.planner.conftest import identity, make_planner, manifest

NOW = 1_000_000.0
_fingerprints = itertools.count()

node = st.sampled_from(["", "n0", "n1", "n2"])
rack = st.sampled_from(["", "r0", "r1"])
zone = st.sampled_from(["", "z0", "z1"])
seed_st = st.fixed_dictionaries(
    {
        "node": node,
        "rack": rack,
        "zone": zone,
        "limit": st.integers(1, 3),
        "live": st.integers(0, 4),
        "ended": st.integers(0, 2),  # finished or expired leases: never counted
        "backends": st.sampled_from([["tcp"], ["shm"], ["tcp", "shm"]]),
    }
)
fleet_st = st.lists(seed_st, min_size=0, max_size=45)


def _fleet(svc: Planner, ident: dict[str, Any], seeds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Register READY seeds of `ident` with their leases; returns them with their ids."""
    out = []
    leases: list[dict[str, Any]] = []
    key = None
    for s in seeds:
        body = RegistrationRequest.model_validate(
            {
                "identity": ident,
                "labels": {"node": s["node"], "rack": s["rack"], "zone": s["zone"]},
                "ranks": [
                    {"rank": 0, "provider": s["backends"][0], "address": "YQ==", "backends": s["backends"]}
                ],
                "max_concurrent_pulls": s["limit"],
            }
        )
        reg = svc.register(body, NOW)
        svc.put_manifest(reg.id, 0, RankManifest.model_validate(manifest(0)).model_dump_json(), NOW)
        svc.set_status(reg.id, "READY", NOW)
        key = svc.get(reg.id).identity_key
        for j in range(s["live"] + s["ended"]):
            ended = j >= s["live"]
            leases.append(
                {
                    "id": uuid.uuid4().hex,
                    "instance_id": reg.id,
                    "rank": 0,
                    "identity_key": key,
                    "provider": "tcp",
                    "created_at": NOW - 5,
                    # an ended lease, or one whose time ran out (expired, not yet reaped)
                    "expires_at": NOW - 1 if ended and j % 2 else NOW + 100,
                    "ended_at": NOW - 1 if ended and not j % 2 else None,
                }
            )
        out.append({**s, "id": reg.id})
    if leases:
        with svc.db.write_core() as conn:
            conn.execute(insert(Lease), leases)
    return out


def _expected(policy_name: str, req: Requester, fleet: list[dict[str, Any]], excluded: set[str], k: int):
    """The old decision: every candidate ranked in Python (None: no candidate at all)."""
    views = [
        SeedView(s["id"], s["node"], s["rack"], s["zone"], s["live"], s["limit"])
        for s in fleet
        if s["id"] not in excluded and choose_provider(["tcp"], [], s["backends"]) is not None
    ]
    if not views:
        return None
    return [v.instance_id for v in make_policy(policy_name).rank(req, views)[:k]]


@pytest.mark.parametrize("policy", ["load_aware", "rendezvous"])
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    fleet=fleet_st,
    who=st.tuples(node, rack, zone),
    key=st.sampled_from(["", "loader-a", "loader-b"]),
    k=st.integers(1, 5),
    data=st.data(),
)
def test_sql_selection_matches_the_whole_fleet_ranking(planner_url, policy, fleet, who, key, k, data):
    svc = make_planner(planner_url, max_candidates=k, selection_policy=policy, heartbeat_ttl_s=1e9)
    try:
        ident = identity(fingerprint=f"sel{next(_fingerprints)}")
        seeds = _fleet(svc, ident, fleet)
        drop = data.draw(st.sets(st.integers(0, 44), max_size=4))
        excluded = {s["id"] for i, s in enumerate(seeds) if i in drop}
        ask = AssignmentRequest.model_validate(
            {
                "identity": ident,
                "rank": 0,
                "providers": ["tcp"],
                "labels": {"node": who[0], "rack": who[1], "zone": who[2]},
                "exclude": sorted(excluded),
                **({"requester_id": key} if key else {}),
            }
        )
        req = Requester(node=who[0], rack=who[1], zone=who[2], key=key or who[0])
        want = _expected(policy, req, seeds, excluded, k)
        if want is None:
            with pytest.raises(NoSource):
                svc.assign(ask, NOW)
        elif not want:
            with pytest.raises(AllBusy):
                svc.assign(ask, NOW)
        else:
            got = svc.assign(ask, NOW)
            assert [c.instance_id for c in got.candidates] == want
    finally:
        svc.close()
