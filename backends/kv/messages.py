"""The KV handshake and request messages, on the engine channel "kv" (JSON fields, one kind each).

receiver -> sender  hello    join: geometry, name, and the receiver's immediate range [base, count]
                             (its channel's): request slot s, layer l is index s * (layers + 1) + l
                             of it, l = layers completing the request. No descriptor: memory is
                             granted per request, in wants, and only to a sender that welcomed
sender -> receiver  welcome  {layers}; or reject {reason} (geometry unusable)
receiver -> sender  want     {rid, slot, part, parts, pages, grant}: a request's destination pages as
                             [start, count] runs, in parts that keep each message small; grant: per
                             run of the part, per layer, per half, [base, key per domain] of a
                             write-only region holding exactly that run's pages (closed when the
                             request settles on the receiver)
sender -> receiver  failed   {rid, reason}: the sender refused a request
receiver -> sender  cancel   {rid}: the receiver gave up on a request; the sender stops writing it
receiver -> sender  bye      the receiver leaves; its requests fail on the sender
The sender's address needs no field: the channel's session proves it (Message.sender).
Every field is bounds-checked before use: page runs before they are expanded (`checked_runs`).
"""

from __future__ import annotations

from collections.abc import Sequence

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
    page_runs: list[list[int]], grant: list[list[list[int]]]
) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Split runs and their grant entries (one list per run) into message-sized parts (JSON of each
    below PART_BYTES, unless one run's entries alone are larger): (runs, flat entries) per part."""
    out: list[tuple[list[list[int]], list[list[int]]]] = [([], [])]
    size = 0
    for r, entries in zip(page_runs, grant, strict=True):
        n = len(str(r)) + len(str(entries))
        if out[-1][0] and size + n > PART_BYTES:
            out.append(([], []))
            size = 0
        out[-1][0].append(r)
        out[-1][1].extend(entries)
        size += n
    return out


def checked_grant(entries: object, runs: int, per_run: int, keys: int) -> list[list[list[int]]]:
    """A want part's grant entries, checked and grouped per run; ValueError otherwise.

    Each entry is [base, key per domain] of 64-bit unsigned integers; the part must hold exactly
    `per_run` entries (layers x halves) for each of its `runs` runs.
    """
    if not isinstance(entries, list) or len(entries) != runs * per_run:
        raise ValueError(f"grant must list {per_run} entries for each of the part's {runs} page runs")
    for e in entries:
        if (
            not isinstance(e, list)
            or len(e) != 1 + keys
            or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**64 for x in e)
        ):
            raise ValueError(f"a grant entry is [base, {keys} key(s)] of 64-bit ints, not {str(e)[:60]!r}")
    return [entries[i * per_run : (i + 1) * per_run] for i in range(runs)]
