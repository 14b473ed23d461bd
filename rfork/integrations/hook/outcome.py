"""How a worker got its weights: what the hook's seed step and its logs need."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rfork.identity import SourceIdentity
    from rfork.pull.result import LoadResult
    from rfork.weights.rank_weights import RankWeights


@dataclasses.dataclass(kw_only=True)
class LoadOutcome:
    """How this rank got its weights (one per loader, set by its last load)."""

    # "rfork-tcp", "nccl", "disk" (rfork's reader, or the framework's inside rfork), or the
    # framework's own loader: "sglang-default", "vllm-default"
    source: str
    seconds: float = 0.0
    bytes: int = 0  # what the load moved (or read) for this rank
    # this rank's share of the model: the bytes of its parameters as the framework sharded them (with
    # TP>1, a checkpoint-mode pull moves the whole checkpoint for a share of it)
    shard_bytes: int = 0
    identity: SourceIdentity | None = None
    rank: int = 0
    served: RankWeights | None = None  # the tensors to serve, when the mode serves what it loaded
    # the pull that filled `served`: its engine and registrations, held until a seed adopts them
    pulled: LoadResult | None = None
    reason: str | None = None  # why it fell back, if it did

    def moved(self, rank: int) -> str:
        """`rank R, N bytes from SOURCE for a S-byte shard (N/S x)`: worker `rank`'s facts for a log line
        (`rank` is the worker's global rank; in checkpoint mode every worker pulls rank 0)."""
        ratio = f"{self.bytes / self.shard_bytes:.2f}x" if self.shard_bytes else "size unknown"
        shard = f"a {self.shard_bytes}-byte shard ({ratio})"
        return f"rank {rank}, {self.bytes} bytes from {self.source} for {shard}"

    def release(self) -> None:
        """Close what the pull holds for a seed (its engine and registrations); no seed adopts them."""
        if self.pulled is not None and self.pulled.seed is None:
            self.pulled.close()
