"""The engine's own rules, in one process: the page-run merge, the cut into pieces and the native core's
gathering of write pieces (hypothesis), the checks every op passes, and the hooks through which
caller-driven endpoints learn of region releases and of close."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends import EngineClosed, MemoryRegionDescriptor, RemoteAccessError, TransferEngine, TransferError
from backends.engine import check_local, check_range, check_remote
from backends.spans import cut_spans, page_spans
from tests.backends.peer import group_pieces


@st.composite
def _paged(draw: st.DrawFn) -> tuple[list[int], int, int, list[int], int, int, int]:
    page_len = draw(st.integers(0, 16))
    s_stride, d_stride = draw(st.integers(page_len, 24)), draw(st.integers(page_len, 24))
    n = draw(st.integers(0, 12))
    src = draw(st.lists(st.integers(0, 15), min_size=n, max_size=n, unique=True))
    dst = draw(st.lists(st.integers(0, 15), min_size=n, max_size=n, unique=True))
    if draw(st.booleans()):  # runs, as allocators often hand out
        src, dst = sorted(src), sorted(dst)
    return src, draw(st.integers(0, 9)), s_stride, dst, draw(st.integers(0, 9)), d_stride, page_len


@settings(max_examples=300, deadline=None)
@given(_paged())
def test_page_spans_move_exactly_the_mapped_pages(
    case: tuple[list[int], int, int, list[int], int, int, int],
) -> None:
    src_pages, s_off, s_stride, dst_pages, d_off, d_stride, page_len = case
    src = np.arange(1000, dtype=np.int64)
    got, want = np.full(1000, -1), np.full(1000, -1)
    spans = page_spans(src_pages, s_off, s_stride, dst_pages, d_off, d_stride, page_len)
    for lo, ro, n in spans:
        assert n > 0
        got[ro : ro + n] = src[lo : lo + n]
    for s, d in zip(src_pages, dst_pages, strict=True):
        so, do = s_off + s * s_stride, d_off + d * d_stride
        want[do : do + page_len] = src[so : so + page_len]
    assert np.array_equal(got, want)
    runs = sum(
        1
        for i in range(len(src_pages))
        if i == 0
        or src_pages[i] * s_stride != src_pages[i - 1] * s_stride + page_len
        or dst_pages[i] * d_stride != dst_pages[i - 1] * d_stride + page_len
    )
    assert len(spans) == (runs if page_len else 0)  # one span per run adjacent on both sides


@st.composite
def _pieces(draw: st.DrawFn) -> tuple[list[tuple[int, int, int]], int]:
    """Write pieces as write_paged and backends.kv make them (cut at max_bytes): apart, adjacent on
    one side, some long; and max_bytes."""
    max_bytes = draw(st.integers(1, 48))
    pieces, lo, ro = [], draw(st.integers(0, 9)), draw(st.integers(0, 9))
    for _ in range(draw(st.integers(0, 24))):
        lo += draw(st.sampled_from([0, 0, 1, 7]))
        ro += draw(st.sampled_from([0, 0, 3, 64]))
        n = draw(st.integers(1, max_bytes))
        pieces.append((lo, ro, n))
        lo, ro = lo + n, ro + n
    return pieces, max_bytes


@settings(max_examples=400, deadline=None)
@given(_pieces(), st.integers(0, 6), st.booleans(), st.sampled_from([0, 0, 20, 64]))
def test_gathered_writes_take_every_piece_once_within_the_limits(
    case: tuple[list[tuple[int, int, int]], int], max_segs: int, scatters: bool, upto: int
) -> None:
    pieces, max_bytes = case
    groups = group_pieces(pieces, max_bytes, max_segs, scatters=scatters, upto=upto)
    assert [piece for g in groups for piece in g] == pieces  # every piece once, in order
    limit = min(max(max_segs, 1), 4)  # RF_MAX_SEGS
    for g in groups:
        assert 1 <= len(g) <= limit
        if len(g) > 1:
            assert upto < sum(n for _, _, n in g) <= max_bytes
            if not scatters:  # one remote iov: the remote ends follow each other
                assert all(b[1] == a[1] + a[2] for a, b in zip(g, g[1:], strict=False))
    if not upto:  # greedy: a write ends only where the next piece could not join it
        for g, nxt in zip(groups, groups[1:], strict=False):
            last, piece = g[-1], nxt[0]
            assert (
                len(g) == limit
                or sum(n for _, _, n in g) + piece[2] > max_bytes
                or (not scatters and piece[1] != last[1] + last[2])
            )


def test_scattered_pages_gather_four_to_a_write() -> None:
    order = [(5, 2), (1, 8), (9, 4), (3, 0), (7, 6), (0, 10)]
    pages = [(p * 32, q * 16, 16) for p, q in order]
    assert [len(g) for g in group_pieces(pages, 1024, 4, scatters=True)] == [4, 2]
    assert [len(g) for g in group_pieces(pages, 1024, 4, scatters=False)] == [1] * 6  # remote apart
    run = [(p * 32, i * 16, 16) for i, (p, _) in enumerate(order)]  # remote adjacent
    assert [len(g) for g in group_pieces(run, 1024, 4, scatters=False)] == [4, 2]
    assert [len(g) for g in group_pieces(run, 40, 4, scatters=True)] == [2, 2, 2]  # max_bytes
    assert [len(g) for g in group_pieces(run, 1024, 4, scatters=True, upto=48)] == [4, 1, 1]
    assert [len(g) for g in group_pieces(run, 1024, 1, scatters=True)] == [1] * 6  # no gathering


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99), st.integers(0, 50)), max_size=12),
    st.integers(1, 20),
)
def test_cut_spans_keeps_every_byte_in_pieces_of_at_most_the_chunk(
    spans: list[tuple[int, int, int]], chunk: int
) -> None:
    pieces = cut_spans(spans, chunk)
    assert all(0 < n <= chunk for _, _, n in pieces)
    moved = [(lo + i, ro + i) for lo, ro, n in pieces for i in range(n)]
    assert moved == [(lo + i, ro + i) for lo, ro, n in spans for i in range(n)]


def test_checks_name_the_op_the_side_and_the_bounds() -> None:
    want = r"^staged read: destination range \[8, 24\) is outside the 16-byte tensor$"
    with pytest.raises(RemoteAccessError, match=want):
        check_range("staged read", "destination", 8, 16, 16, "tensor")
    check_range("x", "local", 0, 16, 16)
    ro = MemoryRegionDescriptor(b"RFEA", (1,), 0, 64, "read")
    with pytest.raises(RemoteAccessError, match=r"^write: remote region grants 'read' access, not write$"):
        check_remote(ro, 0, 8, "write", need="write")
    with pytest.raises(RemoteAccessError, match=r"^read: remote range \[60, 68\) is outside the 64-byte"):
        check_remote(ro, 60, 8, "read", need="read")
    with pytest.raises(RemoteAccessError, match="outside"):
        check_remote(ro, 0, -1, "read", need="read")


def test_hooks_see_releases_and_close_and_unsubscribe() -> None:
    released: list[object] = []
    closed: list[bool] = []
    eng = TransferEngine("tcp", 1, host="127.0.0.1")
    other = TransferEngine("tcp", 1, host="127.0.0.1")
    try:
        unsubscribe = eng.add_hooks(on_release=released.append, on_close=lambda: closed.append(True))
        region = eng.register(np.zeros(64, dtype=np.uint8))
        with pytest.raises(TransferError, match="belongs to another engine"):
            check_local(other, region, 0, 8, "read")
        with pytest.raises(RemoteAccessError, match=r"local range \[60, 68\)"):
            check_local(eng, region, 60, 8, "read")
        region.close()
        assert released == [region]
        with pytest.raises(TransferError, match="deregistered"):
            check_local(eng, region, 0, 8, "read")
        unsubscribe()
        eng.register(np.zeros(64, dtype=np.uint8)).close()
        assert released == [region]
        eng.add_hooks(on_close=lambda: closed.append(True))
        kept = eng.register(np.zeros(64, dtype=np.uint8))
    finally:
        eng.close()
        other.close()
    assert closed == [True]  # the unsubscribed hook is gone, the other ran once
    assert released == [region]
    with pytest.raises(EngineClosed, match="read: engine is closed"):
        check_local(eng, kept, 0, 8, "read")
