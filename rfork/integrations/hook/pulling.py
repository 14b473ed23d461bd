"""Pull inside a framework's worker from the seed the planner names, keeping its signal handlers."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from backends import shard_tensor
from rfork.identity import SourceIdentity
from rfork.integrations.hook.identity import checkpoint_identity
from rfork.integrations.hook.serving import keep_signal_handlers
from rfork.integrations.hook.settings import HookSettings
from rfork.loader import load, pull_into
from rfork.pull.result import LoadResult
from rfork.weights.checkpoint import CheckpointInfo


def pull_checkpoint(
    info: CheckpointInfo, settings: HookSettings, part: tuple[int, int] | None = None
) -> tuple[SourceIdentity, LoadResult]:
    """checkpoint mode: the checkpoint's identity and its unsharded tensors, from a seed or else read
    from `info`'s files by rfork; with `part` = (tp, tp_rank), that TP rank's slice of them (the TP=tp
    checkpoint identity: from its seeds, else from seeds of the whole tensors, else the files).
    Raises when none works."""
    identity = checkpoint_identity(info, model=settings.model, revision=settings.revision)
    rank = 0
    if part is not None:
        identity, rank = identity.model_copy(update={"tp": part[0]}), part[1]
    with keep_signal_handlers():
        result = load(
            identity=identity,
            planner_url=settings.planner_url,
            token=settings.token,
            checkpoint=info,
            ranks=[rank],
            options=settings.load_options(),
        )
    return identity, result


def checkpoint_tensors(
    tensors: Mapping[str, torch.Tensor], info: CheckpointInfo, part: tuple[int, int] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as a framework's weight loaders take them: as pulled, or, for a TP
    rank's slice (`part`), each split tensor at its full shape with the slice in place (the rest zero
    pages, which the framework's loader, sharding the same way, never reads). One at a time, so that
    at most one full-shape copy lives at once."""
    if part is None:
        yield from tensors.items()
        return
    tp, rank = part
    shapes = {t.name: t.shape for t in info.tensors}
    for name, t in tensors.items():
        shape = tuple(shapes[name])
        if tuple(t.shape) == shape:
            yield name, t
            continue
        full = torch.zeros(shape, dtype=t.dtype)
        shard_tensor(name, full, tp, rank).copy_(t)
        yield name, full


def pull_parameters(
    params: Mapping[str, torch.Tensor], *, identity: SourceIdentity, rank: int, settings: HookSettings
) -> LoadResult:
    """parameters mode: one rank straight into `params`' storage (checked against the manifest first,
    verified); raises on no source or any failure, leaving the parameters undefined."""
    with keep_signal_handlers():
        return pull_into(
            identity=identity,
            planner_url=settings.planner_url,
            token=settings.token,
            tensors=params,
            rank=rank,
            options=settings.load_options(),
        )
