"""Source selection: which seeds a loader should pull a rank from, best first.

A policy is one module in this package and one row in POLICIES below; the setting
(`selection_policy`, RFORK_SELECTION_POLICY), `make_policy` and `rfork planner serve --policy` all
take their names from POLICIES. The module's class provides (the SelectionPolicy protocol,
planner.selection.base):

- `name`: the name it is registered under;
- `tiered`: whether `rank` orders by `tier_key` (topology distance, then load) before anything
  else; see the SQL side below;
- `rank(req, seeds)`: the seeds that are not busy, best first (a busy seed is at its pull limit and
  is never returned; the service answers 429 when nothing is left). Plain data in and out: no
  database, no clock, so a policy is tested exhaustively (tests/planner/selection/).

The SQL side (planner.queries, read by `_free_seeds` in planner.service.assignments): a policy is
handed the free seeds that may serve the rank (READY, fresh, unquarantined, manifest matching the
anchor, a transport shared with the requester), read free ones first in pages that grow until they
hold them all. For a `tiered` policy the query orders the free seeds by `tier_key` itself (distance
and load, written again in SQL in `queries._candidates`), and reading stops after the tier of the
`max_candidates`-th free seed: what a decision reads grows with the free seeds near the requester,
not with the fleet. A policy that ranks by anything else sets `tiered = False` and is handed every
free seed; one that sets it to True must rank by `tier_key` first, or it would be handed only a
prefix of the seeds it wants (tests/planner/selection/ checks this for every registered policy). A
new policy needs no SQL; a new SQL order (another key like `tier_key`) is a change to queries.py and
`_free_seeds`.

A policy that draws random numbers takes them from the `rng` its factory is given, so a seeded run
(the simulator) is reproducible. Importing this package costs the standard library only: the
command line lists POLICIES at start-up.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from planner.selection.base import (
    RankReason,
    Requester,
    SeedView,
    SelectionPolicy,
    rank_reason,
    rendezvous_score,
    tier_key,
    topology_distance,
)
from planner.selection.load_aware import LoadAwarePolicy
from planner.selection.random_order import RandomPolicy
from planner.selection.rendezvous import RendezvousPolicy
from planner.selection.transport import choose_provider

# name -> how to build the policy from the run's random source (None: a fresh one)
POLICIES: dict[str, Callable[[random.Random | None], SelectionPolicy]] = {
    "load_aware": lambda rng: LoadAwarePolicy(),
    "random": RandomPolicy,
    "rendezvous": lambda rng: RendezvousPolicy(),
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)

__all__ = [
    "POLICIES",
    "POLICY_NAMES",
    "LoadAwarePolicy",
    "RandomPolicy",
    "RankReason",
    "RendezvousPolicy",
    "Requester",
    "SeedView",
    "SelectionPolicy",
    "choose_provider",
    "make_policy",
    "policy_name",
    "rank_reason",
    "rendezvous_score",
    "tier_key",
    "topology_distance",
]


def policy_name(name: str) -> str:
    """`name` if a policy is registered under it; ValueError naming the choices otherwise (the check of
    the `selection_policy` setting)."""
    if name not in POLICIES:
        raise ValueError(f"selection_policy: unknown policy {name!r} (choose from {sorted(POLICY_NAMES)})")
    return name


def make_policy(name: str, *, rng: random.Random | None = None) -> SelectionPolicy:
    """The policy called `name` (one of POLICY_NAMES); `rng` drives a random one (a seeded Random makes
    it reproducible; the others are deterministic and ignore it)."""
    return POLICIES[policy_name(name)](rng)
