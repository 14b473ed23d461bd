"""Heartbeat coalescing: concurrent heartbeats are written in one UPDATE every `interval_s`.

A heartbeat is answered only after its batch committed (so the status it returns and the 404 for an
unknown instance are as exact as with one UPDATE per request); the reaper's TTL is seconds, so a
delay of `interval_s` (tens of milliseconds) changes nothing it decides.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.concurrency import run_in_threadpool

from planner.service import Planner


class HeartbeatBatcher:
    """Coalesces heartbeats of one event loop; no background task (the first waiter starts a flush)."""

    def __init__(self, planner: Planner, interval_s: float = 0.01) -> None:
        self.planner = planner
        self.interval_s = interval_s
        self._pending: dict[str, list[asyncio.Future[tuple[str, bool] | None]]] = {}
        self._flushing = False
        self._tasks: set[asyncio.Task[Any]] = set()

    async def beat(self, instance_id: str) -> tuple[str, bool] | None:
        """Record a heartbeat; the instance's (status, reverify), or None when it does not exist."""
        fut: asyncio.Future[tuple[str, bool] | None] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(instance_id, []).append(fut)
        if not self._flushing:
            self._flushing = True
            self._spawn()
        return await fut

    def _spawn(self) -> None:
        task = asyncio.get_running_loop().create_task(self._flush())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _flush(self) -> None:
        try:
            await asyncio.sleep(self.interval_s)
            batch, self._pending = self._pending, {}
            try:
                statuses = await run_in_threadpool(self.planner.heartbeat_many, list(batch), time.time())
            except BaseException as exc:  # noqa: BLE001 - every waiter gets the error
                for futs in batch.values():
                    for f in futs:
                        if not f.done():
                            f.set_exception(exc)
                raise
            for iid, futs in batch.items():
                for f in futs:
                    if not f.done():
                        f.set_result(statuses.get(iid))
        finally:
            if self._pending:
                self._spawn()
            else:
                self._flushing = False
