"""The default policy: nearest by topology, then least loaded (tiered: the SQL reads the nearest tiers)."""

from __future__ import annotations

from collections.abc import Sequence

from planner.selection.base import Requester, SeedView, rendezvous_score, tier_key


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
