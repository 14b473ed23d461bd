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
