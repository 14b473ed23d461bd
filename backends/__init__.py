"""Transport library: one-sided RDMA-style transfers over libfabric (tcp, shm, efa, verbs), and the
paths built on it as subpackages: paged KV-cache transfer (`kv`), RL weight updates (`rl`) and MoE
dispatch/combine (`moe`).

Using the engine fails with one line naming what to install when the libfabric binding is not built
(backends.providers._native). Names load on first use; the paths need torch.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Every name resolves on first use: the pure modules (backends.layout, .sharding, .nccl) and a disk
# load must not pay for the libfabric binding (a 0.2 s dlopen) or need it built at all, and the paths
# need torch.
if TYPE_CHECKING:  # the public surface, written once (see _surface)
    from backends import kv, moe, rl
    from backends.channel import Channel, ImmRange, Message
    from backends.descriptor import EngineAddress, MemoryRegionDescriptor
    from backends.digest_job import DigestJob, native_digests_available
    from backends.engine import MAX_MESSAGE, Region, TransferEngine
    from backends.errors import (
        BackendUnavailable,
        ChannelError,
        EngineClosed,
        PeerUnreachable,
        RemoteAccessError,
        TransferError,
        TransferTimeout,
    )
    from backends.providers.registry import provider_available


def _surface() -> dict[str, str]:
    """Each public name -> the module it comes from, read from this file's own import lines.

    The `from backends... import` lines above (under `if TYPE_CHECKING:`) are the one list of the
    surface: type checkers read them as imports, and `__getattr__`, `__all__` and `__dir__` read
    them here, once, from the source. A name imported from `backends` itself is a path (subpackage).
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
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    """A public name, imported on first use (see above for why)."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'backends' has no attribute {name!r}")
    if module == __name__:  # a path: importing it sets the attribute
        return importlib.import_module(f"{module}.{name}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
