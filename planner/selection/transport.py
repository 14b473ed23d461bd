"""Which transport one pull uses between a loader and a seed; a seed that shares none is no candidate."""

from __future__ import annotations

from collections.abc import Sequence

# providers that reach only processes on the same machine (shm: cross-memory attach)
NODE_LOCAL = frozenset({"shm"})


def choose_provider(
    loader_providers: Sequence[str],
    loader_backends: Sequence[str],
    seed_backends: Sequence[str],
    same_node: bool = True,
) -> str | None:
    """The transport for one pull: first one-sided provider both share, else nccl, else None. A
    node-local provider (shm) only when loader and seed are on one node (`same_node`): on the emulated
    fleet every host shares one kernel, so shm between two hosts would work there and nowhere else."""
    seed = set(seed_backends)
    for p in loader_providers:
        if p in seed and p != "nccl" and (same_node or p not in NODE_LOCAL):
            return p
    if "nccl" in seed and ("nccl" in loader_backends or "nccl" in loader_providers):
        return "nccl"
    return None
