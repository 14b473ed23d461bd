"""The loader's destination comes from the tensor list, never from a seed's region sizes (issue #21,
finding 7: a manifest with a 1 PiB region made `load()` allocate and pre-fault it)."""

from __future__ import annotations

import base64

import pytest

from planner.contract import RankManifest
from rfork.errors import ManifestError
from rfork.pull.planner_session import check_manifest
from rfork.weights.rank_weights import RankWeights


def _manifest(region_bytes: int) -> RankManifest:
    return RankManifest.model_validate(
        {
            "rank": 0,
            "checksum_algorithm": "xxh3-128",
            "regions": [{"index": 0, "nbytes": region_bytes, "descriptor": base64.b64encode(b"d").decode()}],
            "tensors": [
                {
                    "name": "w",
                    "dtype": "float32",
                    "shape": [4, 4],
                    "nbytes": 64,
                    "region": 0,
                    "offset": 0,
                    "checksum": "",
                }
            ],
        }
    )


def test_the_destination_is_as_large_as_the_tensors():
    weights = RankWeights.allocate_for(_manifest(64))
    assert weights.layout.region_sizes == (64,)


def test_a_region_larger_than_its_tensors_is_refused_before_anything_is_allocated():
    with pytest.raises(ManifestError, match="region 0"):
        # the loader's one check where it receives the manifest, before allocate_for runs
        check_manifest(_manifest(1 << 20))  # 1 MiB behind 64 bytes (the probe used 1 PiB)
