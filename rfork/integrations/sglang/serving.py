"""Become a seed inside an SGLang scheduler: publish, keep SGLang's signal handlers, leave drain records."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator, Sequence

from rfork.identity import SourceIdentity
from rfork.integrations.sglang import lifecycle
from rfork.seed.seed import Seed
from rfork.weights.rank_weights import RankWeights

log = logging.getLogger(__name__)


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
            instance_id=str(pub.instance_id), token=pub.instance_token, planner_url=planner_url
        )
    log.info("rfork: serving as seed %s (identity %s)", ",".join(seed.instance_ids), identity.key()[:12])
    return seed
