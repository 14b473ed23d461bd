"""Transport library: one-sided RDMA-style transfers over libfabric (tcp, shm, efa, verbs), and the
paths built on it as subpackages: paged KV-cache transfer (`kv`), RL weight updates (`rl`) and MoE
dispatch/combine (`moe`).

Using the engine fails with one line naming what to install when the libfabric binding is not built
(backends.providers._native). Names load on first use; the paths need torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# Every name resolves on first use: the pure modules (backends.layout, .sharding, .nccl) and a disk
# load must not pay for the libfabric binding (a 0.2 s dlopen) or need it built at all, and the paths
# need torch.
_WHERE = {
    "Channel": "backends.channel",
    "ImmRange": "backends.channel",
    "Message": "backends.channel",
    "EngineAddress": "backends.descriptor",
    "MemoryRegionDescriptor": "backends.descriptor",
    "DigestJob": "backends.digest_job",
    "native_digests_available": "backends.digest_job",
    "MAX_MESSAGE": "backends.engine",
    "Region": "backends.engine",
    "TransferEngine": "backends.engine",
    "BackendUnavailable": "backends.errors",
    "ChannelError": "backends.errors",
    "EngineClosed": "backends.errors",
    "PeerUnreachable": "backends.errors",
    "RemoteAccessError": "backends.errors",
    "TransferError": "backends.errors",
    "TransferTimeout": "backends.errors",
    "provider_available": "backends.providers.registry",
}
_PATHS = ("kv", "moe", "rl")

__all__ = [
    "MAX_MESSAGE",
    "BackendUnavailable",
    "Channel",
    "ChannelError",
    "DigestJob",
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
    "native_digests_available",
    "provider_available",
    "rl",
]


def __getattr__(name: str) -> Any:
    """A public name, imported on first use (see above for why)."""
    if name in _PATHS:
        return importlib.import_module(f"backends.{name}")
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'backends' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
