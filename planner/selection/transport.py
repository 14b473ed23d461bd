"""Which transport one pull uses between a loader and a seed; a seed that shares none is no candidate."""

from __future__ import annotations

from collections.abc import Sequence


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
