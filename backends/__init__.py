"""Transport library: one-sided RDMA-style transfers over libfabric (tcp, shm, efa, verbs).

Importing fails with one line naming what to install when the libfabric binding is not built.
"""

from backends.descriptor import EngineAddress, MemoryRegionDescriptor
from backends.engine import MAX_MESSAGE, Region, TransferEngine
from backends.errors import (
    BackendUnavailable,
    EngineClosed,
    PeerUnreachable,
    RemoteAccessError,
    TransferError,
    TransferTimeout,
)
from backends.providers import _native  # noqa: F401  (fails early, with the install hint)
from backends.providers.libfabric import provider_available

__all__ = [
    "MAX_MESSAGE",
    "BackendUnavailable",
    "EngineAddress",
    "EngineClosed",
    "MemoryRegionDescriptor",
    "PeerUnreachable",
    "Region",
    "RemoteAccessError",
    "TransferEngine",
    "TransferError",
    "TransferTimeout",
    "provider_available",
]
