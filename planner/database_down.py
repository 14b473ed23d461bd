"""Answer 503 with Retry-After while the database cannot be reached, on every route.

Pure ASGI around the hot path, the guard (whose token lookups touch the database) and the routes, so
a database that went away is one clean answer per request (`{"reason": "database_unavailable"}`, one
log line), never a 500 with a traceback or a dropped connection. Callers retry as for a busy planner;
/metrics answers on its own (planner.routes.observe). An error after the answer started is re-raised.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Any

import orjson
import psycopg
from sqlalchemy import exc as sa_exc

log = logging.getLogger(__name__)

RETRY_AFTER_S = 2
# connection refused or lost, pool exhausted, SQLite locked; the hot path runs on the driver directly
UNAVAILABLE: tuple[type[BaseException], ...] = (
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    sa_exc.TimeoutError,
    psycopg.OperationalError,
    psycopg.InterfaceError,
    sqlite3.OperationalError,
)


def database_unavailable(exc: BaseException) -> str | None:
    """The first line of a database-unavailable error, or None for any other exception."""
    if not isinstance(exc, UNAVAILABLE):
        return None
    orig = getattr(exc, "orig", None) or exc
    return (str(orig).strip().splitlines() or [type(orig).__name__])[0]


class DatabaseDown:
    """Turns a database-unavailable error raised anywhere inside into 503 + Retry-After."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Run the request; answer 503 if the database failed before any byte of the answer."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            why = database_unavailable(exc)
            if why is None or started:
                raise
            log.warning("database unavailable (%s %s answered 503): %s", scope["method"], scope["path"], why)
            body = orjson.dumps(  # the driver's words (host, port, role) go to the log only
                {"detail": "database unavailable; retry later", "reason": "database_unavailable",
                 "retry_after_s": RETRY_AFTER_S}
            )
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"retry-after", str(RETRY_AFTER_S).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
