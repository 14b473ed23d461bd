"""The KV handshake and request messages, on the engine channel "kv" (JSON fields, one kind each).

receiver -> sender  hello    join: pool descriptor (base64), geometry, name, and the receiver's
                             immediate range [base, count] (its channel's): request slot s, layer l
                             is index s * (layers + 1) + l of it, l = layers completing the request
sender -> receiver  welcome  {layers}; or reject {reason} (geometry or descriptor unusable)
receiver -> sender  want     {rid, slot, part, parts, pages}: a request's destination pages as
                             [start, count] runs, in parts that keep each message small
sender -> receiver  failed   {rid, reason}: the sender refused a request
receiver -> sender  cancel   {rid}: the receiver gave up on a request; the sender stops writing it
receiver -> sender  bye      the receiver leaves; its requests fail on the sender
The sender's address needs no field: the channel's session proves it (Message.sender).
Every field is bounds-checked before use: page runs before they are expanded (`checked_runs`).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

CHANNEL = "kv"
HELLO, WELCOME, REJECT, WANT, FAILED, BYE = "hello", "welcome", "reject", "want", "failed", "bye"
CANCEL = "cancel"
# shm 1.17 stalls on sends above ~4 KiB (docs/transport.md): page lists travel in parts below that.
PART_BYTES = 3000


def imm_index(slot: int, layer: int, layers: int) -> int:
    """Index in the receiver's immediate range for `layer` of the request in `slot` (layers: done)."""
    return slot * (layers + 1) + layer


def b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def unb64(s: str) -> bytes:
    """Inverse of b64; ValueError on anything else."""
    return base64.b64decode(s.encode(), validate=True)


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


def parts(page_runs: list[list[int]]) -> list[list[list[int]]]:
    """Split runs into message-sized parts (JSON of each below PART_BYTES)."""
    out: list[list[list[int]]] = [[]]
    size = 0
    for r in page_runs:
        n = len(str(r[0])) + len(str(r[1])) + 4
        if out[-1] and size + n > PART_BYTES:
            out.append([])
            size = 0
        out[-1].append(r)
        size += n
    return out
