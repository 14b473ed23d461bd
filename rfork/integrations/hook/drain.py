"""Seeds published from a framework's worker processes, drained by the process that started it.

SGLang and vLLM shut down by SIGKILLing their workers (SGLang's schedulers, vLLM's engine core and
workers), so code there may never run on the way out. The process that starts the framework (no
multiprocessing parent) therefore picks a private run directory and exports it; each worker that
publishes a seed writes a record there (instance id, instance token, planner URL; mode 0600). The root
process drains every record, DRAINING then delete, at exit (and SGLang's right before it kills its
schedulers). If the root process itself is SIGKILLed nothing drains: the planner's heartbeat TTL then
marks the seeds STALE.

SGLang drains from its SIGQUIT handler, which a second child's SIGQUIT enters again while the first
drain runs. So the root imports what the drain needs (`prepare`) before that handler is installed (an
import cut short by the handler leaves a half-initialised module that the second entry cannot import),
and the drain is re-entrant: each entry drains the records left, a record another entry already
drained is skipped.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import multiprocessing
import os
import secrets
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rfork.seed.seed import Seed

log = logging.getLogger(__name__)

RUN_DIR_ENV = "RFORK_SGLANG_RUN_DIR"  # its first user's name, kept: it is what running servers export
_armed_pid: int | None = None


def arm_drain_in_main_process() -> bool:
    """In a root process (no multiprocessing parent): export a fresh run directory, drain it at exit.

    Children (the framework's workers) inherit the variable. Cheap: nothing is created on disk here.
    Returns whether this process armed.
    """
    global _armed_pid
    if multiprocessing.parent_process() is not None or _armed_pid == os.getpid():
        return False
    path = Path(tempfile.gettempdir()) / f"rfork-sglang-{os.getpid()}-{secrets.token_hex(6)}"
    os.environ[RUN_DIR_ENV] = str(path)
    _armed_pid = os.getpid()
    atexit.register(drain_recorded)
    return True


def armed_here() -> bool:
    """Whether this process armed the drain (it is the framework's root process)."""
    return _armed_pid == os.getpid()


def prepare() -> None:
    """Import what `drain_recorded` needs, so that no signal handler that drains has to import."""
    # imported here: the frameworks import the plugin in each of their processes (start-up time)
    from planner.contract import PlannerClient  # noqa: F401 - planner.contract loads it on first use


def record_publication(*, instance_id: str, token: str | None, planner_url: str) -> Path | None:
    """Leave a drain record for the main process; None when no run directory was exported."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        log.warning(
            "no %s: seed %s will age out by heartbeat TTL, not drain", RUN_DIR_ENV, instance_id
        )
        return None
    d = Path(run_dir)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = d / f"{instance_id}.json"
    tmp = d / f".{instance_id}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        record = {"instance_id": instance_id, "token": token, "planner_url": planner_url, "pid": os.getpid()}
        json.dump(record, f)
    tmp.replace(path)
    return path


def record_publications(seed: Seed, *, planner_url: str) -> list[Path]:
    """A drain record for each of `seed`'s planner instances; the records written."""
    records: list[Path] = []
    for pub in seed.publications:
        path = record_publication(
            instance_id=str(pub.instance_id), token=pub.instance_token, planner_url=planner_url
        )
        if path is not None:
            records.append(path)
    return records


def drain_recorded(run_dir: str | Path | None = None, *, timeout_s: float = 3.0) -> int:
    """DRAINING + delete every recorded seed (best effort, bounded); returns how many drained."""
    # imported here: the frameworks import the plugin in each of their processes (start-up time)
    from planner.contract import PlannerClient

    d = Path(run_dir or os.environ.get(RUN_DIR_ENV) or "")
    if not str(d) or not d.is_dir():
        return 0
    drained = 0
    for path in sorted(d.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
            with PlannerClient(rec["planner_url"], token=rec.get("token"), timeout_s=timeout_s) as client:
                client.set_status(rec["instance_id"], "DRAINING")
                client.delete_instance(rec["instance_id"])
            drained += 1
            log.info("drained seed %s on %s", rec["instance_id"], rec["planner_url"])
        except Exception as exc:  # noqa: BLE001 - on the way out: the heartbeat TTL is the backstop
            if path.exists():  # else an entry that interrupted this one (a signal handler) drained it
                log.warning("could not drain the seed recorded in %s: %s", path, exc)
        with contextlib.suppress(OSError):
            path.unlink()
    with contextlib.suppress(OSError):
        d.rmdir()
    return drained
