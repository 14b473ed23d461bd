"""How a worker got its weights: what the hook's seed step and its logs need."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rfork.identity import SourceIdentity
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
    reason: str | None = None  # why it fell back, if it did
