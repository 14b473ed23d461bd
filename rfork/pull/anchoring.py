"""Loader side of anchored integrity: a serving seed's manifest must match the identity's anchored digests.

The per-tensor checksums a loader verifies come from the seed's manifest; this check ties that manifest
to the digest set the planner anchored from a disk-loaded publication (planner.integrity), so a seed
cannot vouch for its own corrupted bytes.
"""

from __future__ import annotations

from typing import Any

from planner.integrity import digest_set
from rfork.errors import ChecksumMismatch
from rfork.weights.manifest import RankManifest


def check_anchor(seed_id: str, anchor: dict[str, Any] | None, manifest: RankManifest) -> None:
    """ChecksumMismatch unless `manifest`'s digest set is the anchored one for its algorithm."""
    if not anchor:
        raise ChecksumMismatch(f"seed {seed_id}: the planner sent no anchored digest set; not trusting it")
    if anchor.get("checksum_algorithm") != manifest.checksum_algorithm:
        raise ChecksumMismatch(
            f"seed {seed_id}: manifest algorithm {manifest.checksum_algorithm!r} is not the anchored "
            f"{anchor.get('checksum_algorithm')!r}"
        )
    got = digest_set(manifest.checksum_algorithm, manifest.to_dict()["tensors"])
    if got != anchor.get("digest_set"):
        raise ChecksumMismatch(
            f"seed {seed_id}: manifest digest set {got[:16]} differs from the identity's anchored "
            f"{str(anchor.get('digest_set'))[:16]} (anchored by {anchor.get('instance_id')})"
        )
