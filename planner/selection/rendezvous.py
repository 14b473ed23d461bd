"""The rendezvous policy: hashing keeps each requester on the same seed while that seed lives."""

from __future__ import annotations

from collections.abc import Sequence

from planner.selection.base import Requester, SeedView, rendezvous_score


class RendezvousPolicy:
    """Rendezvous (highest-random-weight) hashing: a requester keeps its seed while that seed lives."""

    name = "rendezvous"
    tiered = False

    def rank(self, req: Requester, seeds: Sequence[SeedView]) -> list[SeedView]:
        """Best-first list of the seeds that are not busy."""
        free = [s for s in seeds if not s.busy]
        return sorted(free, key=lambda s: (-rendezvous_score(req.key, s.instance_id), s.instance_id))
