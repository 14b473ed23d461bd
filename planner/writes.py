"""Group commit of the hot writes (assignments, reports): the requests that arrive while one batch is
being written go in the next, in one thread hop and (SQLite) one transaction (Planner.write_batch).

Per request, a thread-pool hop and a transaction's BEGIN, commit and write-lock hand-off cost more CPU
than its statements (profile in docs/planner.md). A lone request is written at once (no timer); under
load a batch holds what queued during the write before it, so the batch size follows the load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection
from starlette.concurrency import run_in_threadpool

from planner.service import Planner

Step = Callable[[Connection], Callable[[], Any]]


class WriteBatcher:
    """Batches of one event loop. SQLite: one batch in flight, up to `max_batch` requests in one
    transaction (one writer of this process holds the lock for many requests instead of threads
    queueing on it one request at a time). PostgreSQL: Planner.write_batch gives each request its own
    transaction, and a thread serving them one after another waits on the server's round trips; so
    there up to `concurrency` batches of one run at once, as the thread pool ran them before."""

    def __init__(self, planner: Planner, *, max_batch: int = 64, concurrency: int = 1) -> None:
        self.planner = planner
        self.max_batch = max_batch
        self.concurrency = concurrency
        self._pending: list[tuple[Step, asyncio.Future[Any]]] = []
        self._flushers = 0
        self._tasks: set[asyncio.Task[Any]] = set()

    async def run(self, step: Step) -> Any:
        """Run `step` (e.g. Planner.assign_in) in a batch; its continuation's result, or the refusal
        (PlannerError, PermissionError) it raised, returned; any other error (the whole batch's) is raised."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.append((step, fut))
        if self._flushers < self.concurrency:
            self._flushers += 1
            task = loop.create_task(self._flush())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await fut

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
                await self._write(batch)
        finally:
            self._flushers -= 1

    async def _write(self, batch: list[tuple[Step, asyncio.Future[Any]]]) -> None:
        try:
            results = await run_in_threadpool(self.planner.write_batch, [step for step, _ in batch])
        except BaseException as exc:  # noqa: BLE001 - every waiter gets the error
            for _, f in batch:
                if not f.done():
                    f.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, f), r in zip(batch, results, strict=True):
            if not f.done():
                f.set_result(r)
