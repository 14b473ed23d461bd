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
    bytes: int = 0
    identity: SourceIdentity | None = None
    rank: int = 0
    served: RankWeights | None = None  # the tensors to serve, when the mode serves what it loaded
    # the pull that filled `served`: its engine and registrations, held until a seed adopts them
    pulled: LoadResult | None = None
    reason: str | None = None  # why it fell back, if it did

    def release(self) -> None:
        """Close what the pull holds for a seed (its engine and registrations); no seed adopts them."""
        if self.pulled is not None and self.pulled.seed is None:
            self.pulled.close()
