"""One expert-parallel rank in a spawned process, driven by tests/backends/moe/test_expert_parallel.py."""

from __future__ import annotations

import os
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import torch

from tests.backends.moe.cases import Case, apply_expert, expert_tables, rank_inputs


def run_rank(
    conn: Connection, case: Case, rank: int, provider: str, rounds: int, opts: dict[str, Any]
) -> None:
    """Set up one group per wire in opts["wires"] on one engine, blobs brokered by the parent, then run.

    Replies: ("blobs", [blob per wire]), then per wire and round ("round", wire, r, y, expert_counts,
    source_tokens), then ("done",); on any error ("error", message, traceback) and exit. opts also:
    reorder (bool), timeout_s, stall_rank + stall_after (that rank reports ("stalled",) before round
    stall_after and waits to be killed, to test a dead peer).
    """
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    torch.set_num_threads(1)
    from backends import TransferEngine
    from backends.moe import ExpertParallel

    wires = opts.get("wires", [case.wire])
    try:
        kw: dict[str, Any] = {"host": "127.0.0.1"} if provider == "tcp" else {}
        with TransferEngine(
            provider, 1, timeout_s=8.0, chunk_bytes=64 << 20, reorder_for_test=opts.get("reorder", True), **kw
        ) as eng:
            groups = [
                ExpertParallel(
                    eng,
                    rank=rank,
                    world_size=case.world,
                    num_experts=case.num_experts,
                    hidden=case.hidden,
                    topk=case.topk,
                    max_tokens=case.max_tokens,
                    wire=wire,
                    group=wire,
                    timeout_s=opts.get("timeout_s", 20.0),
                )
                for wire in wires
            ]
            conn.send(("blobs", [ep.setup_blob() for ep in groups]))
            for ep, blobs in zip(groups, conn.recv(), strict=True):
                ep.connect(blobs)
            tables = expert_tables(case)
            for wire, ep in zip(wires, groups, strict=True):
                wcase = replace(case, wire=wire)
                mine = torch.nonzero(ep.expert_to_rank == rank).squeeze(1).tolist()
                for r in range(rounds):
                    if opts.get("stall_rank") == rank and r >= opts["stall_after"]:
                        conn.send(("stalled",))
                        conn.recv()  # wait to be killed
                        return
                    x, ids, w = rank_inputs(wcase, rank, r)
                    ep.dispatch_send(x, ids)
                    d = ep.dispatch_recv()
                    for local, pairs in enumerate(d.expert_pairs()):
                        if pairs.numel():
                            d.out[pairs] = apply_expert(tables, mine[local], d.gather(pairs))
                    ep.combine_send(d)
                    y = ep.combine_recv(w)
                    conn.send(("round", wire, r, y, d.expert_counts(), d.source_tokens))
            conn.send(("done",))
            conn.recv()  # stay up until every rank is done: peers may still write to us
            for ep in groups:
                ep.close()
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
        conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
