"""Selection policies as pure functions: property tests with hypothesis."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.selection import (
    POLICY_NAMES,
    LoadAwarePolicy,
    RendezvousPolicy,
    Requester,
    SeedView,
    SelectionPolicy,
    choose_provider,
    make_policy,
    tier_key,
    topology_distance,
)

label = st.sampled_from(["", "a", "b", "c"])


@st.composite
def seeds(draw):
    n = draw(st.integers(0, 12))
    out = []
    for i in range(n):
        limit = draw(st.integers(1, 4))
        out.append(
            SeedView(
                instance_id=f"{i:032x}",
                node=draw(label),
                rack=draw(label),
                zone=draw(label),
                active_leases=draw(st.integers(0, limit + 1)),
                max_concurrent_pulls=limit,
            )
        )
    return out


requesters = st.builds(Requester, node=label, rack=label, zone=label, key=st.text(max_size=8))
# every registered policy (planner.selection.POLICIES), so a new one is held to the same rules
POLICIES: list[SelectionPolicy] = [make_policy(name, rng=random.Random(1)) for name in POLICY_NAMES]


@settings(max_examples=150, deadline=None)
@given(requesters, seeds())
def test_every_policy_returns_exactly_the_free_seeds(req, pool):
    free = {s.instance_id for s in pool if not s.busy}
    for policy in POLICIES:
        ranked = policy.rank(req, pool)
        assert [s.instance_id for s in ranked if s.busy] == []
        assert sorted(s.instance_id for s in ranked) == sorted(free)


@settings(max_examples=150, deadline=None)
@given(requesters, seeds())
def test_load_aware_prefers_near_then_idle(req, pool):
    ranked = LoadAwarePolicy().rank(req, pool)
    keys = [(topology_distance(req, s), s.load) for s in ranked]
    assert keys == sorted(keys)


@settings(max_examples=100, deadline=None)
@given(requesters, seeds(), st.data())
def test_rendezvous_is_stable_when_others_leave(req, pool, data):
    policy = RendezvousPolicy()
    ranked = policy.rank(req, pool)
    if not ranked:
        return
    winner = ranked[0]
    keep = [s for s in pool if s == winner or data.draw(st.booleans())]
    assert policy.rank(req, keep)[0] == winner
    assert policy.rank(req, list(reversed(pool)))[0] == winner


def test_topology_distance():
    seed = SeedView("s", node="n", rack="r", zone="z", active_leases=0, max_concurrent_pulls=1)
    assert topology_distance(Requester(node="n"), seed) == 0
    assert topology_distance(Requester(node="m", rack="r"), seed) == 1
    assert topology_distance(Requester(rack="q", zone="z"), seed) == 2
    assert topology_distance(Requester(), seed) == 3


def test_choose_provider():
    assert choose_provider(["shm", "tcp"], ["nccl"], ["tcp", "shm", "nccl"]) == "shm"
    assert choose_provider(["efa"], ["nccl"], ["tcp", "nccl"]) == "nccl"
    assert choose_provider(["efa"], [], ["tcp", "nccl"]) is None
    assert choose_provider(["tcp"], ["tcp"], ["nccl"]) is None
    assert choose_provider([], [], []) is None


def test_make_policy():
    assert make_policy("random").name == "random"
    with pytest.raises(ValueError, match="selection_policy"):
        make_policy("nope")


def test_every_registered_policy_is_built_under_its_own_name():
    assert {"load_aware", "random", "rendezvous"} <= set(POLICY_NAMES)  # the documented ones
    for name in POLICY_NAMES:
        assert make_policy(name).name == name


@settings(max_examples=150, deadline=None)
@given(requesters, seeds())
def test_a_tiered_policy_ranks_by_tier_key_first(req, pool):
    """What the SQL relies on (planner.queries): it reads a tiered policy's free seeds in tier_key
    order and stops after the tier of the last one the policy may return."""
    for policy in POLICIES:
        if policy.tiered:
            keys = [tier_key(req, s) for s in policy.rank(req, pool)]
            assert keys == sorted(keys), policy.name


def test_importing_the_policies_costs_the_standard_library_only():
    """`rfork --help` lists POLICY_NAMES: importing planner.selection loads no pydantic, httpx, database
    or server module (`planner` spreads the contract's list, whose pydantic types and client load on
    first use)."""
    code = (
        "import sys, planner.selection\n"
        "print([m for m in sys.modules if m.split('.')[0] in ('pydantic', 'httpx', 'sqlalchemy', 'fastapi')"
        " or m.startswith(('planner.service', 'planner.settings'))])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_node_local_provider_only_within_one_node():
    # on the emulated fleet every host shares one kernel, so shm between two hosts would work there and
    # nowhere else: the planner must not offer it across nodes
    assert choose_provider(["shm", "tcp"], [], ["shm", "tcp"], same_node=False) == "tcp"
    assert choose_provider(["shm"], [], ["shm"], same_node=False) is None
    assert choose_provider(["shm", "tcp"], [], ["shm", "tcp"], same_node=True) == "shm"
