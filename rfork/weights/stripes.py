"""Stripes: the verifiable unit of a tensor slice, so that a rank can pull only its shard and check it.

A per-tensor digest cannot verify part of a tensor. A tensor that tensor parallelism splits
(`backends.sharding.split_dim`) is therefore also cut into `count` equal stripes along that dim,
`count` = gcd(size of the dim, MAX_STRIPES), and each stripe has its own digest: the manifest's
algorithm over the stripe's bytes in row-major order (`t.narrow(dim, i * w, w)`, gathered where the
dim is not 0). A rank of TP=k (k dividing `count`) holds exactly count/k whole stripes of each split
tensor, so it reads only its shard and verifies every byte of it, TP 1, 2, 4 and 8 alike.

A manifest carries the stripe digests beside each tensor's own digest (`TensorStripes`), and the
identity's anchored digest set covers them (`planner.contract.integrity.digest_set`): they are trusted
exactly as far as the per-tensor digests are. Cost: one more digest pass over the split tensors where
the manifest is made (a checkpoint seed, an anchor upload); a loader that reads a shard digests only
its own bytes; up to 8 digests per split tensor in the manifest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from backends import split_dim
from planner.contract import SourceIdentity, TensorStripes
from rfork.identity import CHECKPOINT_LAYOUT
from rfork.weights import checksum as ck

MAX_STRIPES = 8  # TP sizes 1, 2, 4 and 8 read whole stripes


@dataclass(frozen=True, slots=True)
class StripeGrid:
    """How one tensor is striped: `count` equal stripes along `dim`."""

    dim: int
    count: int

    def width(self, shape: Sequence[int]) -> int:
        """Size of one stripe along `dim`."""
        return shape[self.dim] // self.count

    def for_rank(self, tp: int, rank: int) -> range | None:
        """The stripes TP rank `rank` of `tp` holds, or None where `tp` does not divide the stripes."""
        if self.count % tp:
            return None
        per = self.count // tp
        return range(rank * per, (rank + 1) * per)


def grid_for(name: str, shape: Sequence[int]) -> StripeGrid | None:
    """The stripes of tensor `name` of `shape`, or None where TP does not split it (or cannot evenly)."""
    dim = split_dim(name, len(shape))
    if dim is None:
        return None
    count = math.gcd(int(shape[dim]), MAX_STRIPES)
    return StripeGrid(dim, count) if count > 1 else None


def stripe(tensor: torch.Tensor, grid: StripeGrid, index: int) -> torch.Tensor:
    """Stripe `index` of `tensor` (a view)."""
    w = grid.width(tensor.shape)
    return tensor.narrow(grid.dim, index * w, w)


def stripe_digests(parts: Sequence[torch.Tensor]) -> list[str]:
    """The digest of each stripe's bytes in row-major order (a gathered copy where it is strided), the
    stripes spread over the digest threads (RFORK_DIGEST_THREADS): one stripe is an eighth of a tensor,
    too little for one digest's own threads to pay off."""
    if len(parts) <= 1:
        return [ck.tensor_checksum(p.contiguous()) for p in parts]
    with ThreadPoolExecutor(max_workers=ck.blake3_threads(), thread_name_prefix="rfork-stripes") as pool:
        return list(pool.map(lambda p: ck.tensor_checksum(p.contiguous(), threads=1), parts))


def tensors_stripes(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorStripes]:
    """Every stripe's digest of each striped tensor in `tensors` (those TP does not split: none)."""
    grids = {name: grid_for(name, tuple(t.shape)) for name, t in tensors.items() if t.numel()}
    jobs = [(name, grid) for name, grid in grids.items() if grid is not None]
    parts = [stripe(tensors[name], grid, i) for name, grid in jobs for i in range(grid.count)]
    digests = iter(stripe_digests(parts))
    return {
        name: TensorStripes(dim=grid.dim, digests=[next(digests) for _ in range(grid.count)])
        for name, grid in jobs
    }


def publishes_stripes(identity: SourceIdentity) -> bool:
    """Whether seeds of `identity` publish stripe digests: whole checkpoint tensors (the checkpoint
    layout at TP=1, PP=1), which a rank of any TP may read its shard from."""
    return (
        identity.framework == "rfork"
        and identity.framework_version == CHECKPOINT_LAYOUT
        and identity.tp == 1
        and identity.pp == 1
    )


def whole_identity(identity: SourceIdentity) -> SourceIdentity | None:
    """The identity whose seeds hold the whole tensors a rank of `identity` may read its shard from (the
    checkpoint layout at TP=1), or None where there is none (another layout, TP=1 already, or PP > 1)."""
    if identity.framework != "rfork" or identity.framework_version != CHECKPOINT_LAYOUT:
        return None
    if identity.tp == 1 or identity.pp != 1:
        return None
    return identity.model_copy(update={"tp": 1})
