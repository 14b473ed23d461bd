"""Drain this instance's seeds when vLLM shuts down.

vLLM loads the weights in a worker process (a multiprocessing child of the engine core, itself a
child of the API server), or all in one process with `VLLM_ENABLE_V1_MULTIPROCESSING=0` and the `uni`
executor (`vllm.LLM`). Its default shutdown is abrupt: on SIGTERM the API server signals the engine
core and, with the default `--shutdown-timeout 0`, SIGKILLs it and the worker at once, so no code in
the worker runs on the way out. Two ways out, both armed:

- the root process (the API server, which loads the plugin too) exported a private run directory
  (`rfork.integrations.hook.drain`, as the SGLang hook's); a worker that publishes a seed writes a
  drain record there, and the root process drains every record at exit (atexit);
- a `multiprocessing.util.Finalize` drains the seed in the process that holds it, when that process
  exits by itself or by SystemExit (vLLM's SIGTERM handlers raise it; atexit does not run in a
  multiprocessing child) and removes its records, so the root process does not drain it twice.

A SIGKILLed API server drains nothing: the planner's heartbeat TTL then marks the seeds STALE.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
from multiprocessing import util
from pathlib import Path
from typing import TYPE_CHECKING

from rfork.integrations.hook import drain

if TYPE_CHECKING:
    from rfork.seed.seed import Seed

log = logging.getLogger(__name__)

# before multiprocessing's own teardown (priority 0 and None) and vLLM's shared-memory finalizers
DRAIN_EXIT_PRIORITY = 100


def drain_at_exit(seed: Seed, *, planner_url: str) -> None:
    """Drain `seed` when this process exits, or from the root process when vLLM kills this one."""
    records: list[Path] = []
    if multiprocessing.parent_process() is not None:  # a root process drains itself (Finalize)
        records = drain.record_publications(seed, planner_url=planner_url)
    util.Finalize(None, _drain, args=(seed, records), exitpriority=DRAIN_EXIT_PRIORITY)


def _drain(seed: Seed, records: list[Path]) -> None:
    ids = ",".join(seed.instance_ids)
    try:
        seed.close()
        log.info("rfork: drained seed %s", ids)
    except Exception as exc:  # noqa: BLE001 - on the way out: the root process or the TTL is the backstop
        log.warning("rfork: could not drain seed %s: %s", ids, exc)
        return
    for path in records:
        with contextlib.suppress(OSError):
            path.unlink()
