"""backends.kv without a transport: a layer's page spans and page-list messages (property tests), geometry."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.kv.messages import parts, runs, unruns
from backends.kv.pool import KvError, KvGeometry, layer_spans


@st.composite
def _mapping(draw: st.DrawFn) -> tuple[KvGeometry, list[int], KvGeometry, list[int], int]:
    layers = draw(st.integers(1, 4))
    page = draw(st.sampled_from([1, 8, 64]))
    sp_n, dp_n = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    n = draw(st.integers(0, min(sp_n, dp_n)))
    src = draw(st.permutations(range(sp_n)))[:n]
    dst = draw(st.permutations(range(dp_n)))[:n]
    if draw(st.booleans()):  # runs, as allocators often hand out
        src, dst = sorted(src), sorted(dst)
    layer = draw(st.integers(0, layers - 1))
    return KvGeometry(layers, sp_n, page), list(src), KvGeometry(layers, dp_n, page), list(dst), layer


@settings(max_examples=300, deadline=None)
@given(_mapping())
def test_layer_spans_move_exactly_the_mapped_pages(
    case: tuple[KvGeometry, list[int], KvGeometry, list[int], int],
) -> None:
    sg, sp, dg, dp, layer = case
    src = np.arange(sg.nbytes, dtype=np.int64)
    dst = np.full(dg.nbytes, -1, dtype=np.int64)
    spans = layer_spans(sg, sp, dg, dp, layer)
    for lo, ro, n in spans:
        assert n > 0
        dst[ro : ro + n] = src[lo : lo + n]
    want = np.full(dg.nbytes, -1, dtype=np.int64)
    for kv in (0, 1):
        for s, d in zip(sp, dp, strict=True):
            so, do = sg.offset(layer, kv, s), dg.offset(layer, kv, d)
            want[do : do + sg.page_bytes] = src[so : so + sg.page_bytes]
    assert np.array_equal(dst, want)
    if (
        sp == list(range(sp[0], sp[0] + len(sp))) and dp == list(range(dp[0], dp[0] + len(dp)))
        if sp
        else False
    ):
        assert len(spans) == 2  # one run per half when both sides are contiguous


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 100_000), max_size=3000))
def test_page_runs_round_trip_and_fit_in_small_messages(pages: list[int]) -> None:
    page_runs = runs(pages)
    assert unruns(page_runs) == pages
    regions = [[2**47, 2**64 - 1]] * 4  # 2 layers x K, V
    grant = [[s, n, regions] for s, n in runs(sorted(set(pages)))]
    split = parts(page_runs, grant)
    assert [r for p, _ in split for r in p] == page_runs
    assert [g for _, gs in split for g in gs] == grant
    assert all(len(json.dumps({"pages": p, "grant": g})) < 3500 for p, g in split)


def test_geometry_refuses_bad_shapes() -> None:
    with pytest.raises(ValueError, match="layers"):
        KvGeometry(0, 4, 16)
    with pytest.raises(ValueError, match="layers"):
        KvGeometry(5000, 4, 16)
    with pytest.raises(ValueError, match="positive"):
        KvGeometry(2, 0, 16)
    with pytest.raises(KvError, match="page id 9"):
        KvGeometry(2, 8, 16).check_pages([1, 9], "test")
