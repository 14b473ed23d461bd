"""What a selection policy is given and must provide (planner.selection says how to add one).

A policy sees only plain data (no database), so it is cheap to test exhaustively: the requester and
the READY seed ranks that could serve it, each with its live leases and pull limit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SeedView:
    """One READY seed rank as a policy sees it."""

    instance_id: str
    node: str
    rack: str
    zone: str
    active_leases: int
    max_concurrent_pulls: int

    @property
    def busy(self) -> bool:
        """At (or over) its pull limit."""
        return self.active_leases >= self.max_concurrent_pulls

    @property
    def load(self) -> float:
        """Fraction of its pull limit in use."""
        return self.active_leases / self.max_concurrent_pulls


@dataclass(frozen=True)
class Requester:
    """Who asks: its labels and a stable key (requester id, else node) for hashing."""

    node: str = ""
    rack: str = ""
    zone: str = ""
    key: str = ""


def topology_distance(req: Requester, seed: SeedView) -> int:
    """0 same node, 1 same rack, 2 same zone, 3 elsewhere (empty labels never match)."""
    if req.node and req.node == seed.node:
        return 0
    if req.rack and req.rack == seed.rack:
        return 1
    if req.zone and req.zone == seed.zone:
        return 2
    return 3


def tier_key(req: Requester, seed: SeedView) -> tuple[int, float]:
    """What a tiered policy ranks by first (topology distance, load); the SQL orders free seeds alike."""
    return topology_distance(req, seed), seed.load


def rendezvous_score(key: str, instance_id: str) -> int:
    """Highest-random-weight hash of (requester key, seed)."""
    return int.from_bytes(hashlib.blake2b(f"{key}|{instance_id}".encode(), digest_size=8).digest(), "big")


class SelectionPolicy(Protocol):
    """Orders the non-busy seeds, best first."""

    name: str
    tiered: bool  # ranks by tier_key first: a prefix of the free seeds in that order is enough

    def rank(self, req: Requester, seeds: Sequence[SeedView]) -> list[SeedView]:
        """Best-first list of the seeds that are not busy."""
        ...


TIERS = ("node", "rack", "zone", "elsewhere")  # topology_distance 0..3, as a CandidateReason names it
_WHERE = ("same node", "same rack", "same zone", "another zone")
# what each policy ranks by, for the candidate's reason (a policy not listed is named alone)
POLICY_ORDER = {
    "load_aware": "nearest tier, then least loaded, then a hash spreads ties",
    "random": "random order of the free seeds",
    "rendezvous": "rendezvous hash of the requester and the seed",
}


@dataclass(frozen=True)
class RankReason:
    """Why a seed is where it is in a decision (the wire's CandidateReason, as plain data)."""

    policy: str
    tier: str
    active_leases: int
    max_concurrent_pulls: int
    rack_hold: bool
    summary: str


def rank_reason(policy: str, req: Requester, seed: SeedView, *, rack_hold: bool = False) -> RankReason:
    """The reason for `seed`'s place in `policy`'s order for `req`. `rack_hold`: the rack-hold rule
    applied to this decision (the requester's rack is checked for seeds first)."""
    distance = topology_distance(req, seed)
    summary = (
        f"{_WHERE[distance]} (node {seed.node or '?'}, rack {seed.rack or '?'}), "
        f"{seed.active_leases}/{seed.max_concurrent_pulls} pulls busy; "
        f"{policy}: {POLICY_ORDER.get(policy, 'its own order')}"
    )
    if rack_hold:
        summary += (
            "; rack hold: a seed in the requester's rack"
            if req.rack and req.rack == seed.rack
            else "; rack hold: the requester's rack has no seed that could serve it"
        )
    return RankReason(
        policy=policy,
        tier=TIERS[distance],
        active_leases=seed.active_leases,
        max_concurrent_pulls=seed.max_concurrent_pulls,
        rack_hold=rack_hold,
        summary=summary,
    )
