"""The KV handshake and request messages, on the engine channel "kv" (JSON fields, one kind each).

receiver -> sender  hello    join: geometry, name, and the receiver's immediate range [base, count]
                             (its channel's): request slot s, layer l is index s * (layers + 1) + l
                             of it, l = layers completing the request. No descriptor: memory is
                             granted per request, in wants, and only to a sender that welcomed
sender -> receiver  welcome  {layers}; or reject {reason} (geometry unusable)
receiver -> sender  want     {rid, slot, part, parts, pages, grant}: a request's destination pages as
                             [start, count] runs, in parts that keep each message small; grant:
                             [start, count, regions] per range of pages adjacent in memory (the
                             request's pages sorted), regions per layer and half [base, key per
                             domain] of a write-only region holding exactly that range (closed
                             when the request settles on the receiver)
sender -> receiver  failed   {rid, reason}: the sender refused a request
receiver -> sender  cancel   {rid}: the receiver gave up on a request; the sender stops writing it
receiver -> sender  bye      the receiver leaves; its requests fail on the sender
The sender's address needs no field: the channel's session proves it (Message.sender).
Every field is bounds-checked before use: page runs before they are expanded (`checked_runs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CHANNEL = "kv"
HELLO, WELCOME, REJECT, WANT, FAILED, BYE = "hello", "welcome", "reject", "want", "failed", "bye"
CANCEL = "cancel"
# shm 1.17 stalls on sends above ~4 KiB (docs/transport.md): page lists travel in parts below that.
PART_BYTES = 3000


def imm_index(slot: int, layer: int, layers: int) -> int:
    """Index in the receiver's immediate range for `layer` of the request in `slot` (layers: done)."""
    return slot * (layers + 1) + layer


def runs(pages: Sequence[int]) -> list[list[int]]:
    """[[start, count], ...]: page lists are mostly runs, and messages must stay small."""
    out: list[list[int]] = []
    for p in pages:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1][1] += 1
        else:
            out.append([p, 1])
    return out


def unruns(page_runs: Sequence[Sequence[int]]) -> list[int]:
    """Inverse of runs (for runs checked_runs accepted)."""
    return [s + i for s, n in page_runs for i in range(int(n))]


def checked_runs(page_runs: object, pages: int, budget: int) -> list[list[int]]:
    """A peer's page runs, checked before anything is expanded; ValueError otherwise.

    Each run is [start, count] with 0 <= start, 1 <= count, start + count <= pages, and the runs
    hold at most `budget` pages in all.
    """
    if not isinstance(page_runs, list):
        raise ValueError("pages must be a list of [start, count] runs")  # noqa: TRY004
    total = 0
    out: list[list[int]] = []
    for r in page_runs:
        if (
            not isinstance(r, list)
            or len(r) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)
        ):
            raise ValueError(f"a page run is [start, count], not {str(r)[:40]!r}")
        start, count = r
        if start < 0 or count < 1 or start + count > pages:
            raise ValueError(f"page run [{start}, {count}] is outside 0..{pages - 1}")
        total += count
        if total > budget:
            raise ValueError(f"page runs hold more than {budget} pages")
        out.append([start, count])
    return out


def parts(
    page_runs: list[list[int]], grant: list[list[Any]]
) -> list[tuple[list[list[int]], list[list[Any]]]]:
    """Split page runs and grant items into message-sized parts (JSON of each below PART_BYTES, unless
    one item alone is larger): (runs, grant items) per part, page runs first."""
    out: list[tuple[list[list[int]], list[list[Any]]]] = [([], [])]
    size = 0
    for which, items in ((0, page_runs), (1, grant)):
        for item in items:
            n = len(str(item)) + 2
            if (out[-1][0] or out[-1][1]) and size + n > PART_BYTES:
                out.append(([], []))
                size = 0
            out[-1][which].append(item)
            size += n
    return out


GrantItem = tuple[int, int, list[list[int]]]  # start, count, regions: [base, key per domain] each


def checked_grant(items: object, pages: int, per_range: int, keys: int) -> list[GrantItem]:
    """A want part's grant items, checked; ValueError otherwise.

    Each item is [start, count, entries]: pages start..start+count-1 (inside 0..pages-1) are granted,
    and entries holds `per_range` (layers x halves) entries [base, key per domain] of 64-bit unsigned
    integers, one per region.
    """
    if not isinstance(items, list) or len(items) > pages:
        raise ValueError(f"grant must be a list of at most {pages} [start, count, entries] items")
    out: list[GrantItem] = []
    for item in items:
        if not isinstance(item, list) or len(item) != 3:
            raise ValueError(f"a grant item is [start, count, entries], not {str(item)[:60]!r}")
        start, count, entries = item
        checked_runs([[start, count]], pages, pages)
        if not isinstance(entries, list) or len(entries) != per_range:
            raise ValueError(f"a grant item lists {per_range} regions (layers x halves)")
        for e in entries:
            if (
                not isinstance(e, list)
                or len(e) != 1 + keys
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**64 for x in e)
            ):
                raise ValueError(f"a grant region is [base, {keys} key(s)], 64-bit each, not {str(e)[:40]!r}")
        out.append((start, count, entries))
    return out
