"""Spans as the provider gets them: pages adjacent on both sides merge into one span (page_spans:
engine.write_paged, backends.kv), and spans are cut into pieces of at most the chunk size (cut_spans:
backends.progress). A domain's core gathers write pieces into multi-iov writes (rf_group_pieces)."""

from __future__ import annotations

from collections.abc import Sequence


def page_spans(
    src_pages: Sequence[int],
    src_offset: int,
    src_stride: int,
    dst_pages: Sequence[int],
    dst_offset: int,
    dst_stride: int,
    page_len: int,
) -> list[tuple[int, int, int]]:
    """(src_byte, dst_byte, length) spans moving page src_pages[i] to dst_pages[i], in the given order.

    Page p starts at offset + p * stride on its side. A page that follows the previous one on both
    sides extends its span, so runs of pages cost one span; nothing else is merged or reordered.
    """
    spans: list[tuple[int, int, int]] = []
    if page_len <= 0:
        return spans
    start_s = start_d = 0
    end_s = end_d = -1
    for sp, dp in zip(src_pages, dst_pages, strict=True):
        so, do = src_offset + sp * src_stride, dst_offset + dp * dst_stride
        if so == end_s and do == end_d:
            end_s += page_len
            end_d += page_len
            continue
        if end_s >= 0:
            spans.append((start_s, start_d, end_s - start_s))
        start_s, start_d, end_s, end_d = so, do, so + page_len, do + page_len
    if end_s >= 0:
        spans.append((start_s, start_d, end_s - start_s))
    return spans


def cut_spans(spans: Sequence[tuple[int, int, int]], chunk_bytes: int) -> list[tuple[int, int, int]]:
    """(local, remote, length) spans cut into pieces of at most chunk_bytes, in order (empty ones go)."""
    if all(0 < n <= chunk_bytes for _, _, n in spans):
        return list(spans)
    return [
        (lo + k, ro + k, min(chunk_bytes, n - k)) for lo, ro, n in spans for k in range(0, n, chunk_bytes)
    ]
