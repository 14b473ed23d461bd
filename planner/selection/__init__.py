"""Source selection: which seeds a loader should pull a rank from, best first.

A policy sees only plain data (no database), so it is cheap to test exhaustively. Seeds at their
pull limit are never returned; the caller answers 429 when nothing is left. A `tiered` policy orders
by `tier_key` first, so the caller reads the free seeds in that order (in SQL) only up to the tier of
the last one it returns, not the whole fleet.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

ONE_SIDED = ("tcp", "shm", "efa", "verbs")


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


class LoadAwarePolicy:
    """Default: nearest by topology, then least loaded, then rendezvous hash to spread ties."""

    name = "load_aware"
    tiered = True

    def rank(self, req: Requester, seeds: Sequence[SeedView]) -> list[SeedView]:
        """Best-first list of the seeds that are not busy."""
        free = [s for s in seeds if not s.busy]
        return sorted(
            free,
            key=lambda s: (
                *tier_key(req, s),
                -rendezvous_score(req.key, s.instance_id),
                s.instance_id,
            ),
        )


class RandomPolicy:
    """Uniformly random among the seeds that are not busy."""

    name = "random"
    tiered = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def rank(self, req: Requester, seeds: Sequence[SeedView]) -> list[SeedView]:
        """Best-first list of the seeds that are not busy."""
        free = [s for s in seeds if not s.busy]
        self._rng.shuffle(free)
        return free


class RendezvousPolicy:
    """Rendezvous (highest-random-weight) hashing: a requester keeps its seed while that seed lives."""

    name = "rendezvous"
    tiered = False

    def rank(self, req: Requester, seeds: Sequence[SeedView]) -> list[SeedView]:
        """Best-first list of the seeds that are not busy."""
        free = [s for s in seeds if not s.busy]
        return sorted(free, key=lambda s: (-rendezvous_score(req.key, s.instance_id), s.instance_id))


PolicyName = Literal["load_aware", "random", "rendezvous"]
POLICY_NAMES: tuple[str, ...] = get_args(PolicyName)


def make_policy(name: str, *, rng: random.Random | None = None) -> SelectionPolicy:
    """The policy called `name` (load_aware, random, rendezvous); `rng` drives the random one
    (a seeded Random makes it reproducible; the others are deterministic and ignore it)."""
    if name == "load_aware":
        return LoadAwarePolicy()
    if name == "random":
        return RandomPolicy(rng)
    if name == "rendezvous":
        return RendezvousPolicy()
    raise ValueError(f"selection_policy: unknown policy {name!r} (choose from {sorted(POLICY_NAMES)})")


def choose_provider(
    loader_providers: Sequence[str], loader_backends: Sequence[str], seed_backends: Sequence[str]
) -> str | None:
    """The transport for one pull: first one-sided provider both share, else nccl, else None."""
    seed = set(seed_backends)
    for p in loader_providers:
        if p in seed and p != "nccl":
            return p
    if "nccl" in seed and ("nccl" in loader_backends or "nccl" in loader_providers):
        return "nccl"
    return None
