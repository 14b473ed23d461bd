"""The KV handshake and request messages, on the engine channel "kv" (JSON fields, one kind each).

receiver -> sender  hello    join: pool descriptor (base64), geometry, name, and the receiver's
                             immediate range [base, count] (its channel's): request slot s, layer l
                             is index s * (layers + 1) + l of it, l = layers completing the request
sender -> receiver  welcome  {layers}; or reject {reason} (geometry or descriptor unusable)
receiver -> sender  want     {rid, slot, part, parts, pages}: a request's destination pages as
                             [start, count] runs, in parts that keep each message small
sender -> receiver  failed   {rid, reason}: the sender refused a request
receiver -> sender  bye      the receiver leaves; its requests fail on the sender
The sender's address needs no field: every frame carries it (Message.sender).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

CHANNEL = "kv"
HELLO, WELCOME, REJECT, WANT, FAILED, BYE = "hello", "welcome", "reject", "want", "failed", "bye"
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
    """Inverse of runs."""
    return [s + i for s, n in page_runs for i in range(int(n))]


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
