"""Tensor R-Fork: start LLM instances by pulling weights memory-to-memory from a running seed.

The public surface, what a framework hook and a user call (checked by tests/rfork/test_public_surface.py):

    from rfork import Loader, LoadOptions, SourceIdentity, read_checkpoint_info
    ckpt = read_checkpoint_info("/models/llama")
    result = Loader(identity=ckpt.identity(), planner_url=url, checkpoint=ckpt).load_into(model)

`__all__` is that surface. The errors load with the package; every other name resolves on first use:
`rfork --help` and the SGLang plugin (loaded in every SGLang process) import this package, and must
not pay for torch and the transport until they need them.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from rfork.errors import (
    NEEDS_TORCH,
    CheckpointError,
    ChecksumMismatch,
    ConfigurationError,
    DestinationMismatch,
    Interrupted,
    LayoutError,
    LoadFailed,
    ManifestError,
    PullError,
    RforkError,
    SeedRequired,
)

try:
    __version__ = version("rfork")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

if TYPE_CHECKING:  # at run time these load on first use, from the modules `_LAZY` names
    from rfork.identity import SourceIdentity
    from rfork.loader import Loader, load, pull_into
    from rfork.pull.one_sided import warm_transport
    from rfork.pull.options import LoadOptions
    from rfork.pull.result import Attempt, LoadResult
    from rfork.seed.seed import Seed
    from rfork.weights.checkpoint import CheckpointInfo, read_checkpoint_info
    from rfork.weights.rank_weights import RankWeights

__all__ = [
    "Attempt",
    "CheckpointError",
    "CheckpointInfo",
    "ChecksumMismatch",
    "ConfigurationError",
    "DestinationMismatch",
    "Interrupted",
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
    "SeedRequired",
    "SourceIdentity",
    "__version__",
    "load",
    "pull_into",
    "read_checkpoint_info",
    "warm_transport",
]

# Where each lazy name of `__all__` loads from on first use (see the module docstring for why).
_LAZY = {
    "rfork.identity": ("SourceIdentity",),
    "rfork.loader": ("Loader", "load", "pull_into"),
    "rfork.pull.one_sided": ("warm_transport",),
    "rfork.pull.options": ("LoadOptions",),
    "rfork.pull.result": ("Attempt", "LoadResult"),
    "rfork.seed.seed": ("Seed",),
    "rfork.weights.checkpoint": ("CheckpointInfo", "read_checkpoint_info"),
    "rfork.weights.rank_weights": ("RankWeights",),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (see the module docstring for why)."""
    module = _HOME.get(name)
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


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
