"""Request guard (pure ASGI, outside FastAPI): body size limit and authentication before any body is read.

FastAPI reads and parses a request's body before its dependencies run, so without this an anonymous
caller could make the planner buffer and parse hundreds of megabytes (and be answered 422, not 401).
Here, before the application sees the request:
  1. a declared Content-Length over the route's limit is answered 413 without reading the body; a body
     without Content-Length (chunked) is read up to the limit, 413 beyond it, and replayed;
  2. on /v1/ routes the bearer token is checked (401 when missing or unknown) and the principal is
     left in `scope["state"]["principal"]` for planner.deps.get_principal.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.concurrency import run_in_threadpool

from planner.auth import Authenticator, Principal

MANIFEST_MARK = "/manifests/"


class RequestGuard:
    """Body limits for every route (`manifest_limit` for manifest PUTs, else `body_limit`), auth for /v1/."""

    def __init__(self, app: Any, *, state: Any, body_limit: int, manifest_limit: int) -> None:
        self.app = app
        self.state = state
        self.body_limit = body_limit
        self.manifest_limit = manifest_limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Guard one request."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        limit = self.manifest_limit if MANIFEST_MARK in path and scope["method"] == "PUT" else self.body_limit
        declared: int | None = None
        chunked = False
        token = ""
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _answer(send, 400, "Content-Length: not an integer")
                    return
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"authorization":
                scheme, _, rest = value.decode("latin-1").partition(" ")
                token = rest.strip() if scheme.lower() == "bearer" else ""
        if declared is not None and declared > limit:
            await _answer(send, 413, f"body: {declared} bytes exceeds this route's limit of {limit} bytes")
            return
        auth: Authenticator | None = self.state.authenticator
        if auth is not None and path.startswith("/v1/"):
            principal = await _authenticate(auth, token)
            if principal is None:
                why = "unknown token" if token else "a bearer token is required"
                await _answer(send, 401, f"Authorization: {why}", {"WWW-Authenticate": "Bearer"})
                return
            scope.setdefault("state", {})["principal"] = principal
        if chunked and declared is None:
            body = bytearray()
            more = True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    break
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > limit:
                    await _answer(send, 413, f"body: exceeds this route's limit of {limit} bytes")
                    return
            await self.app(scope, replay(bytes(body)), send)
            return
        await self.app(scope, receive, send)


async def _authenticate(auth: Authenticator, token: str) -> Principal | None:
    if not token:
        return None
    cached = auth.authenticate_cached(token)
    if cached is False or cached is True:
        return await run_in_threadpool(auth.authenticate, token)
    return cached


def replay(body: bytes) -> Any:
    """A `receive` that gives `body` once (a request whose body was already read), then disconnect."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def _answer(send: Any, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    # the body was not read: the connection cannot be reused for a next request
    raw.append((b"connection", b"close"))
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
