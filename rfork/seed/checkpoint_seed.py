"""A seed of a safetensors checkpoint on disk: one process at tp=1, one child process per TP rank above.

Each rank is read straight into flat region buffers (`rfork.weights.checkpoint.load_rank_from_disk`),
registered read-only per provider and published. With tp > 1 every rank runs in its own process
(its own engine and memory, as an inference server's ranks would) and this process publishes one
planner instance per provider covering every rank. `serve_checkpoint` returns once READY.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import multiprocessing as mp
import signal
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from backends import TransferEngine
from planner.contract import RankEndpoint, RankManifest
from rfork.identity import SourceIdentity
from rfork.seed.publication import Publication
from rfork.seed.seed import RankServer, Seed
from rfork.weights.checkpoint import CheckpointInfo, load_rank_from_disk, read_checkpoint_info
from rfork.weights.rank_weights import RankWeights

log = logging.getLogger(__name__)

_WORKER_REPORT_S = 600.0


def serve_checkpoint(
    info: CheckpointInfo,
    *,
    identity: SourceIdentity,
    planner_url: str,
    providers: Sequence[str],
    token: str | None,
    domains: int = 1,
    max_region_bytes: int,
    max_concurrent_pulls: int = 2,
    control: bool = True,
) -> tuple[list[str], Callable[[], None]]:
    """Serve every rank of `identity` (tp = identity.tp) from the checkpoint; (instance ids, close)."""
    if identity.tp == 1:
        layout, buffers, tensors = load_rank_from_disk(info, max_region_bytes=max_region_bytes)
        weights = RankWeights(rank=0, layout=layout, buffers=buffers, tensors=tensors)
        seed = Seed(
            weights=[weights],
            identity=identity,
            planner_url=planner_url,
            providers=providers,
            token=token,
            domains=domains,
            max_concurrent_pulls=max_concurrent_pulls,
            control=control,
        )
        seed.start()
        return seed.instance_ids, seed.close
    return _serve_tp(
        info,
        identity=identity,
        planner_url=planner_url,
        providers=providers,
        token=token,
        domains=domains,
        max_region_bytes=max_region_bytes,
        max_concurrent_pulls=max_concurrent_pulls,
    )


def _serve_tp(
    info: CheckpointInfo,
    *,
    identity: SourceIdentity,
    planner_url: str,
    providers: Sequence[str],
    token: str | None,
    domains: int,
    max_region_bytes: int,
    max_concurrent_pulls: int,
) -> tuple[list[str], Callable[[], None]]:
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in range(identity.tp):
        parent, child = ctx.Pipe()
        p = ctx.Process(
            target=_rank_worker,
            args=(child, str(info.directory), identity.tp, rank, list(providers), domains, max_region_bytes),
            daemon=True,
        )
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    pubs: list[Publication] = []

    def close() -> None:
        for pub in pubs:
            pub.close()
        for c in conns:
            try:
                c.send("stop")
            except OSError:
                log.debug("rank worker pipe already closed")
        for p in procs:
            p.join(timeout=15)
            if p.is_alive():
                p.kill()

    try:
        results = [_worker_result(rank, c) for rank, c in enumerate(conns)]
        for i, provider in enumerate(providers):
            rows, manifests = [], {}
            for rank, per_provider in enumerate(results):
                prov, address, manifest = per_provider[i]
                assert prov == provider
                rows.append(
                    RankEndpoint(
                        rank=rank,
                        provider=provider,
                        address=base64.b64encode(address).decode(),
                        backends=[provider],
                    )
                )
                manifests[rank] = RankManifest.model_validate(manifest)
            pubs.append(
                Publication(
                    planner_url=planner_url,
                    token=token,
                    identity=identity,
                    ranks=rows,
                    manifests=manifests,
                    max_concurrent_pulls=max_concurrent_pulls,
                )
            )
    except BaseException:
        close()
        raise
    return [str(p.instance_id) for p in pubs], close


def _worker_result(rank: int, conn: Connection) -> Any:
    if not conn.poll(_WORKER_REPORT_S):
        raise TimeoutError(f"rank {rank} worker did not report within {_WORKER_REPORT_S:.0f} s")
    status, payload = conn.recv()
    if status != "ok":
        raise RuntimeError(payload)
    return payload


def _rank_worker(
    conn: Connection,
    directory: str,
    tp: int,
    rank: int,
    providers: list[str],
    domains: int,
    max_region_bytes: int,
) -> None:
    """Child process for one TP rank: load its slice, register per provider, report, wait for stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    servers: list[RankServer] = []
    try:
        layout, buffers, tensors = load_rank_from_disk(
            read_checkpoint_info(directory), tp=tp, rank=rank, max_region_bytes=max_region_bytes
        )
        weights = RankWeights(rank=rank, layout=layout, buffers=buffers, tensors=tensors)
        weights.compute_checksums()
        rows = []
        for provider in providers:
            server = RankServer(engine=TransferEngine(provider, domains, timeout_s=10.0))
            servers.append(server)
            served = server.serve(weights)
            rows.append(
                (provider, server.address_bytes(), weights.manifest(served.descriptors()).model_dump())
            )
        conn.send(("ok", rows))
        with contextlib.suppress(EOFError, OSError):
            conn.recv()  # "stop", or EOF when the parent died
    except Exception as exc:  # noqa: BLE001 - report to the parent, which exits non-zero
        with contextlib.suppress(Exception):
            conn.send(("error", f"rank {rank}: {exc}"))
    finally:
        for server in servers:
            server.close()
