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
from planner.wire import HeartbeatAnswer, InstanceStatus, dump_json


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


HEARTBEAT_ROUTE = "/v1/instances/{instance_id}/heartbeat"
_PREFIX, _SUFFIX = "/v1/instances/", "/heartbeat"
_HEX = frozenset("0123456789abcdef")


class HeartbeatFastPath:
    """Pure ASGI: answers the common heartbeat (known token allowed to change that instance, instance
    exists) without FastAPI's routing and dependency solving, about a third of its CPU per request.

    Anything else (no or unknown token, another instance's token, an unknown instance, a token not
    in the cache yet) falls through to the FastAPI route, which gives the documented 4xx answers.
    """

    def __init__(self, app: Any, batcher: HeartbeatBatcher, state: Any) -> None:
        self.app = app
        self.batcher = batcher
        self.state = state
        self.route: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Serve one request."""
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if (
            scope.get("method") != "POST"
            or len(path) != len(_PREFIX) + 32 + len(_SUFFIX)
            or not path.startswith(_PREFIX)
            or not path.endswith(_SUFFIX)
        ):
            await self.app(scope, receive, send)
            return
        instance_id = path[len(_PREFIX) : len(_PREFIX) + 32]
        if not _HEX.issuperset(instance_id) or not self._allowed(scope, instance_id):
            await self.app(scope, receive, send)
            return
        beat = await self.batcher.beat(instance_id)
        if beat is None:
            await self.app(scope, receive, send)  # the route answers 404
            return
        if self.route is None:
            self.route = next(
                (r for r in scope["app"].routes if getattr(r, "path", None) == HEARTBEAT_ROUTE), None
            )
        scope["route"] = self.route  # for the metrics' route label
        answer = HeartbeatAnswer(
            status=InstanceStatus(beat[0]),
            ttl_s=self.batcher.planner.settings.heartbeat_ttl_s,
            reverify=beat[1],
        )
        body = dump_json(answer)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _allowed(self, scope: Any, instance_id: str) -> bool:
        auth = self.state.authenticator
        if auth is None:
            return True  # --insecure: every caller is admin
        token = ""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer":
                    return False
                break
        if not token:
            return False
        principal = auth.authenticate_cached(token.strip())
        return bool(principal) and principal is not True and principal.may_change(instance_id)
