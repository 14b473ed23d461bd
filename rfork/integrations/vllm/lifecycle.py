"""Drain this process's seeds when vLLM shuts it down.

vLLM loads the weights in its engine-core process (a multiprocessing child, spawned) or, with
`VLLM_ENABLE_V1_MULTIPROCESSING=0`, in the server process itself. On SIGTERM the API server stops and
terminates the engine core, whose handler raises SystemExit, so that process exits through
multiprocessing's exit function, which runs `multiprocessing.util.Finalize` callbacks, while atexit
handlers do not run in a multiprocessing child. A Finalize with an exit priority runs in both cases
(multiprocessing registers its exit function with atexit in the root process), so that is where the
seed drains: DRAINING, delete, deregister. A SIGKILLed process drains nothing: the planner's
heartbeat TTL then marks its seeds STALE.
"""

from __future__ import annotations

import logging
from multiprocessing import util

from rfork.seed.seed import Seed

log = logging.getLogger(__name__)

# before multiprocessing's own teardown (priority 0 and None) and vLLM's shared-memory finalizers
DRAIN_EXIT_PRIORITY = 100


def drain_at_exit(seed: Seed) -> None:
    """Close (drain) `seed` when this process exits normally or by SystemExit (SIGTERM in vLLM)."""
    util.Finalize(None, _drain, args=(seed,), exitpriority=DRAIN_EXIT_PRIORITY)


def _drain(seed: Seed) -> None:
    try:
        seed.close()
        log.info("rfork: drained seed %s", ",".join(seed.instance_ids))
    except Exception as exc:  # noqa: BLE001 - on the way out: the heartbeat TTL is the backstop
        log.warning("rfork: could not drain seed %s: %s", ",".join(seed.instance_ids), exc)
