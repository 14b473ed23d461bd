"""The digest set of a rank manifest: what the planner anchors and loaders check a seed's manifest against.

A manifest's per-tensor checksums are only as trustworthy as the seed that computed them; a seed whose
memory was corrupted after loading publishes checksums of the corrupted bytes. So the planner records,
per (identity, rank, checksum algorithm), the digest set of the first publication made by an instance
that loaded from disk, refuses later manifests whose set differs, and hands the anchored set's hash to
loaders, which check the serving seed's manifest against it before trusting its per-tensor checksums.
Pure stdlib: imported by both the planner and the loader.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

CRYPTOGRAPHIC_DIGESTS = frozenset({"blake3"})  # checksum algorithms a crafted collision cannot match


def is_cryptographic(checksum_algorithm: str) -> bool:
    """Whether a crafted collision cannot match the algorithm's digests (blake3; not xxh3-128 or
    pmix64-v1, which guard against accidents only)."""
    return checksum_algorithm in CRYPTOGRAPHIC_DIGESTS


def digest_set(checksum_algorithm: str, tensors: Iterable[Mapping[str, Any]]) -> str:
    """sha256 hex over the algorithm and every tensor's (name, dtype, shape, nbytes, checksum), by name;
    a tensor with stripe digests adds (dim, digests), so that the anchor covers them too (a tensor
    without any hashes exactly as before)."""
    rows = sorted(_row(t) for t in tensors)
    canon = json.dumps([checksum_algorithm, rows], separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canon.encode()).hexdigest()


def _row(t: Mapping[str, Any]) -> list[Any]:
    row: list[Any] = [
        str(t["name"]), str(t["dtype"]), [int(d) for d in t["shape"]], int(t["nbytes"]), str(t["checksum"])
    ]
    stripes = t.get("stripes")
    if stripes:
        row.append([int(stripes["dim"]), [str(d) for d in stripes["digests"]]])
    return row


def digests(tensors: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """{tensor name: checksum}, as the planner stores an anchor."""
    return {str(t["name"]): str(t["checksum"]) for t in tensors}


def first_difference(anchored: Mapping[str, str], published: Mapping[str, str]) -> str:
    """A short description of where two digest maps differ (for the 409 message and the log)."""
    for name in sorted(set(anchored) | set(published)):
        a, p = anchored.get(name), published.get(name)
        if a != p:
            if a is None:
                return f"tensor {name!r} is not in the anchored set"
            if p is None:
                return f"tensor {name!r} of the anchored set is missing"
            return f"tensor {name!r}: checksum {p} != anchored {a}"
    return "dtype, shape or size differs from the anchored set"
