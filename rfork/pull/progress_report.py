"""A live pull's bytes done, sent to the planner for its fleet page (the live fan-out tree).

The read pipeline calls the reporter from its hot loop, so a call only stores the figure; a helper
thread posts the latest one at most every `interval_s`. A report that fails is dropped (the page
shows a stale figure; the pull never waits on or fails because of the planner).
"""

from __future__ import annotations

import logging
import threading

from planner.contract import PlannerClient
from rfork.pull.options import ProgressFn

log = logging.getLogger(__name__)
# close() waits this long for a report in flight, then leaves it (daemon thread): a hung planner must
# not hold up a pull that has finished; a report landing after the lease's end is refused and ignored
JOIN_TIMEOUT_S = 1.0


class PullProgress:
    """Callable as a ProgressFn(done, total); forwards each call to `forward` (the caller's own) too."""

    def __init__(
        self,
        client: PlannerClient,
        assignment_id: str,
        *,
        forward: ProgressFn | None = None,
        interval_s: float = 0.5,
    ) -> None:
        assert interval_s > 0
        self._client = client
        self._assignment_id = assignment_id
        self._forward = forward
        self._interval_s = interval_s
        self._latest: tuple[int, int] | None = None
        self._sent: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed = False

    def __call__(self, done: int, total: int) -> None:
        if self._forward is not None:
            self._forward(done, total)
        with self._lock:
            self._latest = (done, total)
            start = self._thread is None and not self._stop.is_set()
            if start:
                self._thread = threading.Thread(target=self._run, name="rfork-pull-progress", daemon=True)
        if start:
            assert self._thread is not None
            self._thread.start()

    def close(self) -> None:
        """Stop posting (the lease's report follows with the final figures); waits briefly for the thread."""
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout=JOIN_TIMEOUT_S)

    def _run(self) -> None:
        while True:
            self._send()
            if self._stop.wait(self._interval_s):
                return

    def _send(self) -> None:
        with self._lock:
            latest = self._latest
        if latest is None or latest == self._sent or self._failed:
            return
        try:
            self._client.report_progress(self._assignment_id, bytes_done=latest[0], bytes_total=latest[1])
            self._sent = latest
        except Exception as exc:  # noqa: BLE001 - a lost progress figure must never touch the pull
            self._failed = True  # one warning, no retries: the lease may have ended or the planner be old
            if self._stop.is_set():  # the pull is over: the lease may well have ended meanwhile
                log.debug("late progress of assignment %s not reported: %s", self._assignment_id, exc)
            else:
                log.warning("progress of assignment %s not reported: %s", self._assignment_id, exc)
