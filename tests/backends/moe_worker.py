"""One expert-parallel rank in its own spawned process, driven over a pipe by tests/backends/test_moe.py."""

from __future__ import annotations

import os
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from tests.backends.moe_cases import Case, apply_expert, expert_tables, rank_inputs


def run_rank(
    conn: Connection, case: Case, rank: int, provider: str, rounds: int, opts: dict[str, Any]
) -> None:
    """Set up, exchange blobs through the parent, run `rounds` rounds; send back outputs per round.

    Replies: ("blob", bytes), then per round ("round", r, y, expert_counts, source_tokens), then
    ("done",); on any error ("error", message, traceback) and exit. opts: reorder (bool),
    stall_after (int: stop answering after that many rounds, to test a dead peer).
    """
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    torch.set_num_threads(1)
    from backends import TransferEngine
    from backends.moe import ExpertParallel

    try:
        kw: dict[str, Any] = {"host": "127.0.0.1"} if provider == "tcp" else {}
        with TransferEngine(
            provider, 1, timeout_s=8.0, chunk_bytes=64 << 20, reorder_for_test=opts.get("reorder", True), **kw
        ) as eng:
            ep = ExpertParallel(
                eng,
                rank=rank,
                world_size=case.world,
                num_experts=case.num_experts,
                hidden=case.hidden,
                topk=case.topk,
                max_tokens=case.max_tokens,
                wire=case.wire,
                timeout_s=opts.get("timeout_s", 20.0),
            )
            conn.send(("blob", ep.setup_blob()))
            ep.connect(conn.recv())
            tables = expert_tables(case)
            mine = torch.nonzero(ep.expert_to_rank == rank).squeeze(1).tolist()
            for r in range(rounds):
                if opts.get("stall_after") is not None and r >= opts["stall_after"]:
                    conn.send(("stalled",))
                    conn.recv()  # wait to be killed
                    return
                x, ids, w = rank_inputs(case, rank, r)
                ep.dispatch_send(x, ids)
                d = ep.dispatch_recv()
                for local, pairs in enumerate(d.expert_pairs()):
                    if pairs.numel():
                        d.out[pairs] = apply_expert(tables, mine[local], d.gather(pairs))
                ep.combine_send(d)
                y = ep.combine_recv(w)
                conn.send(("round", r, y, d.expert_counts(), d.source_tokens))
            conn.send(("done",))
            conn.recv()  # stay up until every rank is done: peers may still write to us
            ep.close()
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
        conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
