"""What both sides of a weight-update session agree on: the model's tensors and each rank's TP shard.

A `TensorSpec` is one logical (unsharded) tensor with the dim tensor parallelism splits it along
(None: replicated), by the rule in `backends.sharding`. A rank holding shard `tp_rank` of `tp_size`
stores every tensor's shard contiguously inside a few flat regions placed by `backends.layout`; the
layout is a pure function of (specs, tp_size, tp_rank, max_region_bytes), so peers exchange those
four values, never the per-tensor offsets.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from backends.errors import TransferError
from backends.layout import Layout, dtype_from_name, plan_layout
from backends.sharding import shard_range, split_dim

DEFAULT_MAX_REGION_BYTES = 1 << 30  # few regions: every one costs a registration per slot


class RLError(TransferError):
    """A weight-update session failed or was misused; the message names the rank, peer or field."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One logical tensor: full shape, dtype name ("bfloat16", ...) and its TP split dim or None."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    split_dim: int | None

    def __post_init__(self) -> None:
        dtype_from_name(self.dtype)
        if any(d < 0 for d in self.shape):
            raise RLError(f"tensor {self.name!r}: negative dimension in {self.shape}")
        if self.split_dim is not None and not 0 <= self.split_dim < len(self.shape):
            raise RLError(f"tensor {self.name!r}: split dim {self.split_dim} outside shape {self.shape}")

    def shard_shape(self, tp_size: int, tp_rank: int) -> tuple[int, ...]:
        """Shape of the shard rank `tp_rank` of `tp_size` holds."""
        if self.split_dim is None or tp_size == 1:
            return self.shape
        lo, hi = shard_range(self.shape[self.split_dim], tp_size, tp_rank)
        out = list(self.shape)
        out[self.split_dim] = hi - lo
        return tuple(out)


def model_specs(specs: Iterable[tuple[str, str, Sequence[int]]]) -> tuple[TensorSpec, ...]:
    """TensorSpecs for (name, dtype, full shape) triples, split dims by backends.sharding."""
    out = []
    for name, dtype, shape in specs:
        dims = tuple(int(d) for d in shape)
        out.append(TensorSpec(name, dtype, dims, split_dim(name, len(dims))))
    return tuple(out)


def specs_digest(specs: Sequence[TensorSpec]) -> str:
    """sha256 of the canonical JSON of the specs: peers with different models refuse each other."""
    canon = json.dumps([[s.name, s.dtype, list(s.shape), s.split_dim] for s in specs], separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def check_tp(tp_size: int, tp_rank: int, who: str) -> None:
    """Raise RLError unless 0 <= tp_rank < tp_size."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise RLError(f"{who}: tp_rank {tp_rank} is not in [0, tp_size={tp_size})")


def shard_layout(
    specs: Sequence[TensorSpec],
    *,
    tp_size: int,
    tp_rank: int,
    max_region_bytes: int = DEFAULT_MAX_REGION_BYTES,
) -> Layout:
    """Where rank tp_rank of tp_size keeps its shards: the same placement rule as seeds and loaders."""
    check_tp(tp_size, tp_rank, "shard_layout")
    return plan_layout(
        [(s.name, s.dtype, s.shard_shape(tp_size, tp_rank)) for s in specs], max_region_bytes=max_region_bytes
    )


@dataclass(frozen=True, slots=True)
class TrainerRank:
    """One trainer rank as every session member knows it: engine address and TP position."""

    address: bytes
    tp_size: int
    tp_rank: int
    max_region_bytes: int = DEFAULT_MAX_REGION_BYTES
