"""Source identity: what makes two instances interchangeable, and the weights fingerprint.

`SourceIdentity` is the planner's wire type (planner.wire): one definition for the planner, its client
and rfork. Constructed in Python, quantization, tp/pp/ep/dp, framework, framework_version and
device_kind have defaults; on the wire every field is required.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

from planner.wire import SourceIdentity

__all__ = ["SourceIdentity", "fingerprint", "global_rank"]


def fingerprint(tensors: Iterable[tuple[str, str, Iterable[int]]]) -> str:
    """sha256 (hex) of the sorted (name, dtype, shape) triples of a model's full, unsharded tensors.

    Order of the input does not matter; dtype is the torch name without the "torch." prefix.
    """
    items = sorted(
        (name, str(dtype).removeprefix("torch."), [int(d) for d in shape]) for name, dtype, shape in tensors
    )
    h = hashlib.sha256()
    for name, dtype, shape in items:
        h.update(json.dumps([name, dtype, shape], separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def global_rank(*, tp_rank: int, pp_rank: int, tp_size: int) -> int:
    """pp_rank * tp_size + tp_rank: never tp_rank alone (pipeline stages would collide)."""
    if not 0 <= tp_rank < tp_size or pp_rank < 0:
        raise ValueError(f"bad rank tp_rank={tp_rank} pp_rank={pp_rank} tp_size={tp_size}")
    return pp_rank * tp_size + tp_rank
