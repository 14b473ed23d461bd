"""Transport library: one-sided RDMA-style transfers over libfabric (tcp, shm, efa, verbs), and the
paths built on it as subpackages: paged KV-cache transfer (`kv`), RL weight updates (`rl`) and MoE
dispatch/combine (`moe`), and the two-sided fallback on torch.distributed (`nccl`).

`__all__` is the public surface: this package's names and its paths, each path a door with its own
`__all__` (tests/backends/test_public_surface.py; rfork imports nothing else: tests/test_house.py).

Using the engine fails with one line naming what to install when the libfabric binding is not built
(backends.providers._native). Names load on first use; the paths need torch.
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import TYPE_CHECKING, Any

from backends.errors import (
    BackendUnavailable,
    ChannelError,
    EngineClosed,
    PeerUnreachable,
    RemoteAccessError,
    TransferError,
    TransferTimeout,
)

if TYPE_CHECKING:  # at run time these load on first use, from the modules `_LAZY` names
    from backends import kv, moe, nccl, rl
    from backends.channel import Channel, ImmRange, Message
    from backends.descriptor import EngineAddress, MemoryRegionDescriptor
    from backends.digest_job import DigestJob, native_digests_available
    from backends.engine import MAX_MESSAGE, Region, TransferEngine
    from backends.gpu.staging import StagedReader
    from backends.layout import (
        DEFAULT_MAX_REGION_BYTES,
        Layout,
        Placement,
        dtype_from_name,
        dtype_name,
        expected_nbytes,
        plan_layout,
        views,
    )
    from backends.providers.peer_names import peer_ip
    from backends.providers.registry import AUTO, PROVIDERS, provider_available
    from backends.sharding import shard_shape, shard_tensor, split_dim

__all__ = [
    "AUTO",
    "DEFAULT_MAX_REGION_BYTES",
    "MAX_MESSAGE",
    "PROVIDERS",
    "BackendUnavailable",
    "Channel",
    "ChannelError",
    "DigestJob",
    "EngineAddress",
    "EngineClosed",
    "ImmRange",
    "Layout",
    "MemoryRegionDescriptor",
    "Message",
    "PeerUnreachable",
    "Placement",
    "Region",
    "RemoteAccessError",
    "StagedReader",
    "TransferEngine",
    "TransferError",
    "TransferTimeout",
    "dtype_from_name",
    "dtype_name",
    "expected_nbytes",
    "kv",
    "load_binding_soon",
    "moe",
    "native_digests_available",
    "nccl",
    "peer_ip",
    "plan_layout",
    "provider_available",
    "rl",
    "shard_shape",
    "shard_tensor",
    "split_dim",
    "views",
]

# Where each lazy name of `__all__` loads from on first use ("backends": a path, its subpackage).
# The pure modules (backends.layout, .sharding, .nccl) and a disk load must not pay for the
# libfabric binding (a 0.2 s dlopen) or need it built at all, and the paths and the layout need torch.
_LAZY = {
    "backends": ("kv", "moe", "nccl", "rl"),
    "backends.channel": ("Channel", "ImmRange", "Message"),
    "backends.descriptor": ("EngineAddress", "MemoryRegionDescriptor"),
    "backends.digest_job": ("DigestJob", "native_digests_available"),
    "backends.engine": ("MAX_MESSAGE", "Region", "TransferEngine"),
    "backends.gpu.staging": ("StagedReader",),
    "backends.layout": (
        "DEFAULT_MAX_REGION_BYTES",
        "Layout",
        "Placement",
        "dtype_from_name",
        "dtype_name",
        "expected_nbytes",
        "plan_layout",
        "views",
    ),
    "backends.providers.peer_names": ("peer_ip",),
    "backends.providers.registry": ("AUTO", "PROVIDERS", "provider_available"),
    "backends.sharding": ("shard_shape", "shard_tensor", "split_dim"),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}


_binding_lock = threading.Lock()
_binding_load: threading.Thread | None = None


def load_binding_soon() -> threading.Thread:
    """Start loading the libfabric binding on a helper thread, once per process, so that the first
    engine does not wait for it: loading it is a ~0.2 s dlopen (Debian's psm libraries calibrate a
    clock), during which the GIL is free and the caller goes on. Returns that thread. A binding that
    cannot load raises at its first real use."""
    global _binding_load

    def load() -> None:
        try:
            importlib.import_module("backends.providers._native")
        except ImportError:
            return  # said, with what to install, where the engine is used

    with _binding_lock:
        if _binding_load is None:
            _binding_load = threading.Thread(target=load, name="rfork-load-binding", daemon=True)
            _binding_load.start()
            # a fork while the loader lock is held would leave the child unable to load any library
            os.register_at_fork(before=_binding_load.join)
        return _binding_load


def __getattr__(name: str) -> Any:
    """A lazy public name, imported on first use (PEP 562; see `_LAZY` for why)."""
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'backends' has no attribute {name!r}")
    if module == __name__:  # a path: importing it sets the attribute
        return importlib.import_module(f"{module}.{name}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
