"""rfork.weights.rank_weights: covering ranges in place, checks against a manifest, digests, host mirrors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.contract import RankManifest
from rfork.errors import ChecksumMismatch, DestinationMismatch, LayoutError
from rfork.pull.read_plan import check_destination
from rfork.weights.rank_weights import RankWeights, cover

# A few backing buffers; tensors are byte spans carved out of them (they may overlap or repeat).
spans_strategy = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 300), st.integers(0, 120)), min_size=1, max_size=25
)


def carve(spans: list[tuple[int, int, int]]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    backing = [torch.arange(512, dtype=torch.int64).to(torch.uint8) + i for i in range(3)]
    tensors = {f"t{i}": backing[b][off : off + n] for i, (b, off, n) in enumerate(spans)}
    return backing, tensors


def _manifest_for(tensors: dict[str, torch.Tensor]) -> RankManifest:
    w = RankWeights.from_tensors(tensors=tensors)
    return w.manifest([b"x"] * len(w.ranges))


@given(spans_strategy)
@settings(max_examples=150, deadline=None)
def test_cover_places_every_tensor_in_disjoint_ranges_that_hold_only_tensor_bytes(spans):
    _backing, tensors = carve(spans)
    layout, ranges = cover(tensors)
    assert layout.region_sizes == tuple(r.nbytes for r in ranges)
    for a, b in zip(ranges, ranges[1:], strict=False):
        assert a.ptr + a.nbytes < b.ptr  # sorted, neither overlapping nor touching (those merge)
    covered: set[int] = set()
    for p in layout.placements:
        t = tensors[p.name]
        assert p.nbytes == t.numel()
        if p.nbytes:
            r = ranges[p.region]
            assert r.ptr + p.offset == t.data_ptr()
            assert p.offset + p.nbytes <= r.nbytes
            covered.update(range(t.data_ptr(), t.data_ptr() + p.nbytes))
    assert covered == {a for r in ranges for a in range(r.ptr, r.ptr + r.nbytes)}  # no foreign bytes


def test_cover_counts_tied_storage_once_and_refuses_non_contiguous():
    w = torch.randn(64, 32)
    layout, ranges = cover({"embed": w, "lm_head": w, "empty": torch.empty(0, 4)})
    assert len(ranges) == 1
    assert ranges[0].nbytes == w.numel() * 4
    assert [(p.region, p.offset) for p in layout.placements[:2]] == [(0, 0), (0, 0)]
    with pytest.raises(LayoutError, match="'transposed' is not contiguous"):
        cover({"fine": w, "transposed": w.t()})


def test_check_destination_names_the_first_bad_tensor():
    src = {"a": torch.zeros(4, 4), "b": torch.zeros(8, dtype=torch.bfloat16), "c": torch.zeros(2)}
    m = _manifest_for(src)
    check_destination(RankWeights.from_tensors(tensors={k: v.clone() for k, v in src.items()}), m)
    cases = {
        "'b' is bfloat16\\[8\\] at the seed, the destination float32\\[8\\]": {**src, "b": torch.zeros(8)},
        "'a' is float32\\[4, 4\\] at the seed, the destination float32\\[16\\]": {
            **src,
            "a": torch.zeros(16),
        },
        "'c' is in the manifest but has no destination": {"a": src["a"], "b": src["b"]},
        "destination tensor 'd' is not in the manifest": {**src, "d": torch.zeros(1)},
    }
    for message, dest in cases.items():
        with pytest.raises(DestinationMismatch, match=message):
            check_destination(RankWeights.from_tensors(tensors=dest), m)


def test_mismatching_digest_names_the_tensor():
    t = {"w": torch.arange(10, dtype=torch.float32)}
    w = RankWeights.from_tensors(tensors=t)

    with pytest.raises(ChecksumMismatch, match="'w'"):
        w.verify({"w": "0" * 32})


def test_host_mirrors_hold_each_regions_bytes():
    backing = torch.arange(4096, dtype=torch.int32)
    tensors = {"a": backing[:1000], "b": backing[1000:3000], "tied": backing[:1000], "c": torch.ones(7)}
    w = RankWeights.from_tensors(tensors=tensors)
    mirrors = w.host_mirrors()
    assert [m.numel() for m in mirrors] == list(w.layout.region_sizes)
    for p in w.layout.placements:
        got = mirrors[p.region][p.offset : p.offset + p.nbytes]
        assert torch.equal(got, tensors[p.name].reshape(-1).view(torch.uint8)), p.name
    assert mirrors[0].data_ptr() != backing.data_ptr()  # a copy (only GPU weights on tcp need one)
