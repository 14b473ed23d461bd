"""The random policy: a uniformly random order of the free seeds (from the rng it is built with)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from planner.selection.base import Requester, SeedView


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
