"""Tensor R-Fork: start LLM instances by pulling weights memory-to-memory from a running seed.

The public surface, what a framework hook and a user call (checked by tests/rfork/test_public_surface.py):

    from rfork import Loader, LoadOptions, SourceIdentity, read_checkpoint_info
    ckpt = read_checkpoint_info("/models/llama")
    result = Loader(identity=ckpt.identity(), planner_url=url, checkpoint=ckpt).load_into(model)

Names resolve on first use: `rfork --help` and the SGLang plugin (loaded in every SGLang process)
import this package, and must not pay for torch and the transport until they need them.
"""

from __future__ import annotations

import ast
import importlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rfork.errors import NEEDS_TORCH

try:
    __version__ = version("rfork")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

if TYPE_CHECKING:  # the public surface, written once (see _surface)
    from rfork.errors import (
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
    from rfork.identity import SourceIdentity
    from rfork.loader import Loader, load, pull_into
    from rfork.pull.one_sided import warm_transport
    from rfork.pull.options import LoadOptions
    from rfork.pull.result import Attempt, LoadResult
    from rfork.seed.seed import Seed
    from rfork.weights.checkpoint import CheckpointInfo, read_checkpoint_info
    from rfork.weights.rank_weights import RankWeights


def _surface() -> dict[str, str]:
    """Each public name -> the module it comes from, read from this file's own import lines.

    The `from rfork... import` lines above (under `if TYPE_CHECKING:`) are the one list of the
    surface: type checkers read them as imports, and `__getattr__`, `__all__` and `__dir__` read
    them here, once, from the source.
    """
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    lazy = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    lines = tree.body + [node for block in lazy for node in block.body]
    return {
        alias.asname or alias.name: node.module
        for node in lines
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == __name__
        for alias in node.names
    }


_WHERE = _surface()
__all__ = ["__version__", *_WHERE]


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


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
