"""Become a seed inside a framework's worker: keep the framework's signal handlers, serve, publish."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rfork.compile_cache.shelf import CacheShelf
    from rfork.identity import SourceIdentity
    from rfork.integrations.hook.settings import HookSettings
    from rfork.pull.result import LoadResult
    from rfork.seed.seed import Seed
    from rfork.weights.rank_weights import RankWeights

log = logging.getLogger(__name__)


@contextlib.contextmanager
def keep_signal_handlers() -> Iterator[None]:
    """Opening a libfabric engine may replace SIGTERM/SIGINT handlers; put the framework's back after."""
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


def start_seed(
    *,
    weights: Sequence[RankWeights],
    identity: SourceIdentity,
    settings: HookSettings,
    compile_caches: CacheShelf | None = None,
    pulled: LoadResult | None = None,
) -> Seed:
    """Serve `weights` read-only on the settings' one-sided providers (and `compile_caches` on the
    control endpoint), publish READY and heartbeat.

    `pulled`: the load that filled them, holding its engine and registrations (`LoadOptions.seed_later`):
    the seed adopts them, so nothing it registered is registered again. The caller arranges the drain
    (rfork.integrations.hook.drain); raises when the seed cannot start (what `pulled` held is closed).
    """
    # imported here: the frameworks import the plugin in each of their processes (start-up time)
    from rfork.seed.seed import Seed

    if settings.planner_url is None:
        raise ValueError("a seed needs a planner URL")
    one_sided = [p for p in settings.providers if p != "nccl"] or ["tcp"]
    with keep_signal_handlers():
        if pulled is not None:
            seed = Seed.adopt(
                pulled,
                planner_url=settings.planner_url,
                token=settings.seed_token,
                providers=one_sided,
                timeout_s=settings.transfer_timeout_s,
                compile_caches=compile_caches,
                weights=weights,
            )
        else:
            seed = Seed(
                weights=list(weights),
                identity=identity,
                planner_url=settings.planner_url,
                providers=one_sided,
                token=settings.seed_token,
                timeout_s=settings.transfer_timeout_s,
                compile_caches=compile_caches,
            ).start()
    log.info("rfork: serving as seed %s (identity %s)", ",".join(seed.instance_ids), identity.key()[:12])
    return seed
