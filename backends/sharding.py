"""The tensor-parallel sharding rule: which dim of a tensor TP splits, and each rank's slice of it.

Megatron style, as Llama implementations do it: column-parallel (split dim 0) for the q/k/v/gate/up
projections, the embedding (vocab-parallel) and lm_head; row-parallel (split dim 1) for o_proj and
down_proj; a Mixtral expert's w1/w3 (gate/up) like gate/up and its w2 (down) like down_proj, as
tensor-parallel MoE layers shard them; everything else (norms, routers) replicated. A dimension of
size d splits like `torch.tensor_split`: the first d % tp ranks get one extra row. Seeds and loaders
shard checkpoints by it, and the RL path reshards between trainer and inference layouts by it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_COLUMN = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "q_proj.bias",
    "k_proj.bias",
    "v_proj.bias",
    "embed_tokens.weight",
    "lm_head.weight",
)
_ROW = ("o_proj.weight", "down_proj.weight")


_EXPERT_COLUMN = ("w1.weight", "w3.weight")
_EXPERT_ROW = ("w2.weight",)


def split_dim(name: str, ndim: int) -> int | None:
    """Which dim a tensor is split along under TP (None: replicated)."""
    expert = ".experts." in name
    if any(name.endswith(s) for s in _COLUMN) or (expert and name.endswith(_EXPERT_COLUMN)):
        return 0
    if ndim >= 2 and (any(name.endswith(s) for s in _ROW) or (expert and name.endswith(_EXPERT_ROW))):
        return 1
    return None


def shard_range(size: int, tp: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's slice of a dimension of `size` split `tp` ways (first size % tp: one more)."""
    base, extra = divmod(size, tp)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard_shape(name: str, shape: Sequence[int], tp: int, rank: int) -> tuple[int, ...]:
    """The shape of rank's shard of tensor `name` of full `shape`."""
    dim = split_dim(name, len(shape))
    if tp == 1 or dim is None:
        return tuple(shape)
    lo, hi = shard_range(shape[dim], tp, rank)
    out = list(shape)
    out[dim] = hi - lo
    return tuple(out)


def shard_tensor(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank's shard of the full tensor `name` (a view, no copy)."""
    dim = split_dim(name, full.dim())
    if tp == 1 or dim is None:
        return full
    lo, hi = shard_range(full.shape[dim], tp, rank)
    return full.narrow(dim, lo, hi - lo)
