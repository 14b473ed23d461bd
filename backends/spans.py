"""Spans of a write as the provider gets them: pages adjacent on both sides merge into one span
(page_spans: engine.write_paged, backends.kv), and spans that stay apart are gathered into few
multi-iov writes (write_groups: backends.progress)."""

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


def write_groups(
    spans: Sequence[tuple[int, int, int]],
    chunk_bytes: int,
    max_segs: int,
    *,
    scatters: bool,
    ungathered_upto: int = 0,
) -> list[list[tuple[int, int, int]]]:
    """(local, remote, length) spans cut into pieces of at most chunk_bytes, in order, then grouped:
    each group is one posted write of up to max_segs pieces and chunk_bytes in all, so a batch of
    pages costs the provider one op (one message, one acknowledgement, one completion) per group.

    scatters=False: a group's remote ends must follow each other (one remote iov; local ends may lie
    apart). A group of at most ungathered_upto bytes goes back to one piece per group.
    """
    pieces = [
        (lo + k, ro + k, min(chunk_bytes, n - k)) for lo, ro, n in spans for k in range(0, n, chunk_bytes)
    ]
    if max_segs < 2 or len(pieces) < 2:
        return [[piece] for piece in pieces]
    groups: list[list[tuple[int, int, int]]] = []
    group: list[tuple[int, int, int]] = []
    total = remote_end = 0
    for piece in pieces:
        if group and (
            len(group) == max_segs
            or total + piece[2] > chunk_bytes
            or (not scatters and piece[1] != remote_end)
        ):
            groups.append(group)
            group, total = [], 0
        group.append(piece)
        total += piece[2]
        remote_end = piece[1] + piece[2]
    groups.append(group)
    if not ungathered_upto:
        return groups
    return [
        part
        for g in groups
        for part in (
            [[piece] for piece in g] if len(g) > 1 and sum(n for _, _, n in g) <= ungathered_upto else [g]
        )
    ]
