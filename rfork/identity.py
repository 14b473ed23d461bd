"""Who an instance is and where it runs: the source identity (what makes two instances
interchangeable), the weights fingerprint, and the topology labels the planner's selection reads.

`SourceIdentity` is the planner's wire type (planner.contract): one definition for the planner, its client
and rfork. Constructed in Python, quantization, tp/pp/ep/dp, framework, framework_version and
device_kind have defaults; on the wire every field is required.

An identity names the bytes and their layout, never the release of the program that holds them: seeds
and loaders of different rfork releases share a fleet while the bytes and the wire protocol agree
(planner.contract.protocol refuses a peer of another protocol). Checkpoint-named tensors (`rfork seed`,
the hooks' checkpoint mode) carry framework "rfork" and `CHECKPOINT_LAYOUT` as framework_version: the
version of how rfork lays a checkpoint out (names as in the checkpoint, TP shards by
backends.sharding), raised only when that changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Iterable

from planner.contract import SourceIdentity

__all__ = ["CHECKPOINT_LAYOUT", "SourceIdentity", "default_labels", "fingerprint", "global_rank"]

# framework_version of checkpoint-named identities: the layout's version (see the module docstring)
CHECKPOINT_LAYOUT = "checkpoint-v2"  # v2: TP=1 seeds publish stripe digests (rfork.weights.stripes)


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


def default_labels() -> dict[str, str]:
    """Topology labels: $RFORK_NODE / $RFORK_RACK / $RFORK_ZONE when set (and non-empty), else the
    hostname / rack0 / zone0 (deploy/kubernetes/seed.yaml sets RFORK_NODE from the pod's node name)."""
    return {
        "node": os.environ.get("RFORK_NODE") or socket.gethostname(),
        "rack": os.environ.get("RFORK_RACK") or "rack0",
        "zone": os.environ.get("RFORK_ZONE") or "zone0",
    }
