"""Transport library: one-sided RDMA-style transfers over libfabric (tcp, shm, efa, verbs), and the
paths built on it as subpackages: paged KV-cache transfer (`kv`), RL weight updates (`rl`) and MoE
dispatch/combine (`moe`).

Importing fails with one line naming what to install when the libfabric binding is not built. The
paths load on first use (`backends.rl` ...): rl and moe need torch, and `import backends` does not.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from backends.channel import Channel, ImmRange, Message
from backends.descriptor import EngineAddress, MemoryRegionDescriptor
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
from backends.providers.libfabric import provider_available

if TYPE_CHECKING:
    from backends import kv, moe, rl

_PATHS = ("kv", "moe", "rl")

__all__ = [
    "MAX_MESSAGE",
    "BackendUnavailable",
    "Channel",
    "ChannelError",
    "EngineAddress",
    "EngineClosed",
    "ImmRange",
    "MemoryRegionDescriptor",
    "Message",
    "PeerUnreachable",
    "Region",
    "RemoteAccessError",
    "TransferEngine",
    "TransferError",
    "TransferTimeout",
    "kv",
    "moe",
    "provider_available",
    "rl",
]


def __getattr__(name: str) -> ModuleType:
    """The paths, imported on first access (a lazy export: importing them eagerly would load torch)."""
    if name in _PATHS:
        return importlib.import_module(f"backends.{name}")
    raise AttributeError(f"module 'backends' has no attribute {name!r}")
