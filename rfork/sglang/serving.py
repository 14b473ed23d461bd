"""Become a seed from inside an SGLang scheduler: serve tensors where they live, publish, record."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence

import torch

from rfork.errors import RforkError
from rfork.identity import SourceIdentity
from rfork.layout import Layout, Placement
from rfork.manifest import dtype_name
from rfork.seed import RankWeights, Seed
from rfork.sglang import lifecycle

log = logging.getLogger(__name__)


class ServeError(RforkError):
    """Tensors cannot be served in place (non-contiguous, or on a device the transport cannot reach)."""


def in_place_weights(*, rank: int, tensors: Mapping[str, torch.Tensor]) -> RankWeights:
    """RankWeights whose regions are the tensors' own bytes: one region per tensor, no copy.

    The module keeps its storage (SGLang's memory saver, CUDA graphs and weight updates rely on it).
    Tensors that share storage (tied weights) appear once each, under their own names.
    """
    placements: list[Placement] = []
    buffers: list[torch.Tensor] = []
    views: dict[str, torch.Tensor] = {}
    sizes: list[int] = []
    for name, t in tensors.items():
        t = t.detach()
        if not t.is_contiguous():
            raise ServeError(f"tensor {name!r} is not contiguous; it cannot be served in place")
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            shape = tuple(int(d) for d in t.shape)
            placements.append(
                Placement(name=name, dtype=dtype_name(t.dtype), shape=shape, nbytes=0, region=0, offset=0)
            )
            views[name] = t
            continue
        placements.append(
            Placement(
                name=name,
                dtype=dtype_name(t.dtype),
                shape=tuple(int(d) for d in t.shape),
                nbytes=nbytes,
                region=len(buffers),
                offset=0,
            )
        )
        buffers.append(t.reshape(-1).view(torch.uint8))
        sizes.append(nbytes)
        views[name] = t
    layout = Layout(region_sizes=tuple(sizes), placements=tuple(placements))
    return RankWeights(rank=rank, layout=layout, buffers=buffers, tensors=views)


@contextlib.contextmanager
def keep_signal_handlers() -> Iterator[None]:
    """Opening a libfabric engine may replace SIGTERM/SIGINT handlers; put SGLang's back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def publish_seed(
    *,
    weights: Sequence[RankWeights],
    identity: SourceIdentity,
    planner_url: str,
    token: str | None,
    providers: Sequence[str],
    transfer_timeout_s: float,
) -> Seed:
    """Register read-only, publish READY, heartbeat, and leave drain records for SGLang's main process."""
    one_sided = [p for p in providers if p != "nccl"] or ["tcp"]
    seed = Seed(
        weights=list(weights),
        identity=identity,
        planner_url=planner_url,
        providers=one_sided,
        token=token,
        timeout_s=transfer_timeout_s,
    )
    with keep_signal_handlers():
        seed.start()
    for pub in seed.publications:
        lifecycle.record_publication(
            instance_id=pub.instance_id, token=pub.instance_token, planner_url=planner_url
        )
    log.info("rfork: serving as seed %s (identity %s)", ",".join(seed.instance_ids), identity.key()[:12])
    return seed
