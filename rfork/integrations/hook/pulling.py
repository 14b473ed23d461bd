"""Pull inside a framework's worker from the seed the planner names, keeping its signal handlers."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rfork.identity import SourceIdentity
from rfork.integrations.hook.identity import checkpoint_identity
from rfork.integrations.hook.serving import keep_signal_handlers
from rfork.integrations.hook.settings import HookSettings
from rfork.loader import load, pull_into
from rfork.pull.result import LoadResult
from rfork.weights.checkpoint import CheckpointInfo


def pull_checkpoint(info: CheckpointInfo, settings: HookSettings) -> tuple[SourceIdentity, LoadResult]:
    """checkpoint mode: the checkpoint's identity and its unsharded tensors, from a seed or else read
    from `info`'s files by rfork; raises when neither works."""
    identity = checkpoint_identity(info, model=settings.model, revision=settings.revision)
    with keep_signal_handlers():
        result = load(
            identity=identity,
            planner_url=settings.planner_url,
            token=settings.token,
            checkpoint=info,
            ranks=[0],
            options=settings.load_options(),
        )
    return identity, result


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
