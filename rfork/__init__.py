"""Tensor R-Fork: start LLM instances by pulling weights memory-to-memory from a running seed.

The public surface, what a framework hook and a user call (pinned by tests/rfork/test_public_surface.py):

    from rfork import Loader, LoadOptions, SourceIdentity, read_checkpoint_info
    ckpt = read_checkpoint_info("/models/llama")
    result = Loader(identity=ckpt.identity(), planner_url=url, checkpoint=ckpt).load_into(model)

Names resolve on first use: `rfork --help` and the SGLang plugin (loaded in every SGLang process)
import this package, and must not pay for torch and the transport until they need them.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from rfork.errors import NEEDS_TORCH

try:
    __version__ = version("rfork")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

_WHERE = {
    "Loader": "rfork.pull.loader",
    "load": "rfork.pull.loader",
    "pull_into": "rfork.pull.loader",
    "LoadOptions": "rfork.pull.result",
    "LoadResult": "rfork.pull.result",
    "Attempt": "rfork.pull.result",
    "warm_transport": "rfork.pull.one_sided",
    "Seed": "rfork.seed.seed",
    "RankWeights": "rfork.weights.rank_weights",
    "CheckpointInfo": "rfork.weights.checkpoint",
    "read_checkpoint_info": "rfork.weights.checkpoint",
    "SourceIdentity": "rfork.identity",
    "RforkError": "rfork.errors",
    "PullError": "rfork.errors",
    "LoadFailed": "rfork.errors",
    "ChecksumMismatch": "rfork.errors",
    "DestinationMismatch": "rfork.errors",
    "CheckpointError": "rfork.errors",
    "ManifestError": "rfork.errors",
    "LayoutError": "rfork.errors",
}

__all__ = [
    "Attempt",
    "CheckpointError",
    "CheckpointInfo",
    "ChecksumMismatch",
    "DestinationMismatch",
    "LayoutError",
    "LoadFailed",
    "LoadOptions",
    "LoadResult",
    "Loader",
    "ManifestError",
    "PullError",
    "RankWeights",
    "RforkError",
    "Seed",
    "SourceIdentity",
    "__version__",
    "load",
    "pull_into",
    "read_checkpoint_info",
    "warm_transport",
]

if TYPE_CHECKING:
    from rfork.errors import (
        CheckpointError,
        ChecksumMismatch,
        DestinationMismatch,
        LayoutError,
        LoadFailed,
        ManifestError,
        PullError,
        RforkError,
    )
    from rfork.identity import SourceIdentity
    from rfork.pull.loader import Loader, load, pull_into
    from rfork.pull.one_sided import warm_transport
    from rfork.pull.result import Attempt, LoadOptions, LoadResult
    from rfork.seed.seed import Seed
    from rfork.weights.checkpoint import CheckpointInfo, read_checkpoint_info
    from rfork.weights.rank_weights import RankWeights


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (see the module docstring for why)."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'rfork' has no attribute {name!r}")
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        raise ModuleNotFoundError(NEEDS_TORCH, name="torch") from exc
    value = getattr(loaded, name)
    globals()[name] = value
    return value
