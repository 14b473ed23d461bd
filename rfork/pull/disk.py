"""Loading a rank from the checkpoint on disk: the fallback when no seed can serve it.

Nothing to compare digests with, so such a load is not verified; a seed it becomes computes its
digests when it starts.
"""

from __future__ import annotations

import logging
import time

from rfork.errors import LoadFailed
from rfork.pull.options import ProgressFn
from rfork.pull.result import Attempt
from rfork.weights.checkpoint import CheckpointInfo, load_rank_from_disk, read_rank_into
from rfork.weights.rank_weights import RankWeights

log = logging.getLogger(__name__)


def load_from_disk(
    checkpoint: CheckpointInfo | None,
    *,
    rank: int,
    tp: int,
    dest: RankWeights | None,
    attempts: list[Attempt],
    progress: ProgressFn | None,
) -> RankWeights:
    """Read rank `rank` (of `tp`) into `dest`, or into fresh region buffers; records the attempt.

    LoadFailed, naming the last failed attempt, when there is no checkpoint to fall back to.
    """
    if checkpoint is None:
        last = next((a.error for a in reversed(attempts) if a.error), None)
        raise LoadFailed(
            f"rank {rank}: no seed could serve it and no checkpoint directory to fall back to "
            f"({len(attempts)} failed attempt(s){'; last: ' + last if last else ''})"
        )
    log.info("rank %d: loading from disk %s", rank, checkpoint.directory)
    t0 = time.perf_counter()
    if dest is None:
        layout, buffers, tensors = load_rank_from_disk(checkpoint, tp=tp, rank=rank)
        weights = RankWeights(rank=rank, layout=layout, buffers=buffers, tensors=tensors)
    else:
        read_rank_into(checkpoint, dest.tensors, tp=tp, rank=rank)
        weights = dest
        weights.checksums.clear()  # whatever a failed pull left there is not these bytes'
    seconds = time.perf_counter() - t0
    total = weights.layout.total_bytes
    log.info("rank %d from disk: read %.3f s (not verified: no digests to compare)", rank, seconds)
    if progress is not None:
        progress(total, total)
    attempts.append(
        Attempt(
            source="disk",
            instance_id=None,
            rank=rank,
            ok=True,
            bytes=total,
            seconds=seconds,
            phases={"read": seconds},
        )
    )
    return weights
