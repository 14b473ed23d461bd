"""Refuse requests of a wire protocol this planner does not speak (planner.contract.protocol).

Pure ASGI, outside the hot path and the routes, so a peer of another protocol never registers, leases
or reports: one 400 `{"reason": "protocol_version"}` naming both versions, before auth and the body.
"""

from __future__ import annotations

from typing import Any

import orjson

from planner.contract.protocol import HEADER, REASON, protocol_problem

_HEADER = HEADER.lower().encode("latin-1")


class ProtocolGuard:
    """Answers 400 for a `X-Rfork-Protocol` this planner does not speak; passes everything else on."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Check one request's protocol header."""
        if scope["type"] == "http":
            value = next((v for k, v in scope.get("headers", ()) if k == _HEADER), None)
            problem = protocol_problem(None if value is None else value.decode("latin-1"))
            if problem is not None:
                body = orjson.dumps({"detail": problem, "reason": REASON})
                await send(
                    {
                        "type": "http.response.start",
                        "status": 400,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
