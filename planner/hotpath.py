"""The hot requests (heartbeat, assignment, report) answered beside FastAPI, in pure ASGI.

A fleet's steady load is heartbeats, and a scale-up's is assignments and reports. For these three,
FastAPI's routing, dependency solving, request objects and the guard's generic work were most of the
CPU per request (profile in docs/planner.md). This middleware answers the common case of each with
the same code the routes call (planner.routes.assignments.lease/finish, the heartbeat batcher) and
the same wire types; every other case falls through, body replayed, to the FastAPI app, which gives
the documented answer: no or unknown token (or one not cached yet), a role that may not, a body over
the limit or not declared by Content-Length, a content type other than JSON, a body that is not valid
JSON or not a valid request (422 with its `loc`), an unknown instance (404). A service error
(PlannerError: 404 no_source, 409, 429 all_busy) is answered here as the app's handler would; any
other exception was raised in a transaction that rolled back, so the request falls through and the
app answers it (403 for another holder's lease, 422/409 for database errors).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from planner.answers import planner_error_response
from planner.auth import INSECURE, Principal
from planner.contract import wire
from planner.contract.errors import PlannerError
from planner.contract.manifest import dump_json
from planner.guard import replay
from planner.heartbeats import HeartbeatBatcher
from planner.routes.assignments import finished, lease_refusal, leased, reporter
from planner.writes import Step, WriteBatcher

log = logging.getLogger(__name__)

HEARTBEAT_ROUTE = "/v1/instances/{instance_id}/heartbeat"
ASSIGNMENT_ROUTE = "/v1/assignments"
REPORT_ROUTE = "/v1/assignments/{assignment_id}/report"
_INSTANCES, _HEARTBEAT = "/v1/instances/", "/heartbeat"
_ASSIGNMENTS, _REPORT = "/v1/assignments/", "/report"
_HEX = frozenset("0123456789abcdef")
_JSON = b"application/json"


@dataclass(frozen=True)
class RouteName:
    """What the metrics middleware reads of a matched route."""

    path: str


_ROUTES = {t: RouteName(t) for t in (HEARTBEAT_ROUTE, ASSIGNMENT_ROUTE, REPORT_ROUTE)}
Handler = Callable[[Any, Any, Any, Principal, str, bytes], Awaitable[bool]]


class HotPath:
    """Pure ASGI, inside the metrics middleware and outside the request guard (it does the guard's
    checks itself: a declared body within `body_limit`, a cached token)."""

    def __init__(
        self, app: Any, *, state: Any, batcher: HeartbeatBatcher, writes: WriteBatcher, body_limit: int
    ) -> None:
        self.app = app
        self.state = state
        self.batcher = batcher
        self.writes = writes
        self.body_limit = body_limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Serve one request, or hand it to the app."""
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        handler: Handler | None = None
        ident = ""
        if path == ASSIGNMENT_ROUTE:
            handler = self._assignment
        elif _hex_between(path, _INSTANCES, _HEARTBEAT):
            handler, ident = self._heartbeat, path[len(_INSTANCES) : -len(_HEARTBEAT)]
        elif _hex_between(path, _ASSIGNMENTS, _REPORT):
            handler, ident = self._report, path[len(_ASSIGNMENTS) : -len(_REPORT)]
        principal = self._principal(scope) if handler is not None else None
        if handler is None or principal is None:
            await self.app(scope, receive, send)
            return
        body = b""
        if handler is not self._heartbeat:  # the heartbeat route reads no body
            read = await _read_json_body(scope, receive)
            if read is None:
                await self.app(scope, receive, send)
                return
            body, receive = read, replay(read)
        if not await handler(scope, receive, send, principal, ident, body):
            await self.app(scope, receive, send)

    def _principal(self, scope: Any) -> Principal | None:
        """The caller when its token is known without a lookup and its declared body is small enough."""
        token = ""
        length: int | None = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer":
                    return None
            elif name == b"content-length":
                length = int(value) if value.isdigit() else -1
        if length is not None and not 0 <= length <= self.body_limit:
            return None
        auth = self.state.authenticator
        if auth is None:
            return INSECURE
        principal = auth.authenticate_cached(token.strip()) if token.strip() else None
        return principal if isinstance(principal, Principal) else None

    @staticmethod
    def _route(scope: Any, template: str) -> None:
        """Name the route in the scope, as the router would, for the metrics' route label (which reads
        only its `path`; FastAPI's own route objects sit inside included routers)."""
        scope["route"] = _ROUTES[template]

    async def _heartbeat(
        self, scope: Any, receive: Any, send: Any, who: Principal, iid: str, _: bytes
    ) -> bool:
        if not who.may_change(iid):
            return False
        try:
            beat = await self.batcher.beat(iid)
        except Exception:  # noqa: BLE001 - the batch rolled back; the route writes this one and answers
            log.debug("hot path: heartbeat of %s falls through to the app", iid, exc_info=True)
            return False
        if beat is None:
            return False  # the route answers 404
        self._route(scope, HEARTBEAT_ROUTE)
        answer = wire.HeartbeatAnswer(
            status=wire.InstanceStatus(beat[0]),
            ttl_s=self.batcher.planner.settings.heartbeat_ttl_s,
            reverify=beat[1],
        )
        await _send_json(send, 200, dump_json(answer))
        return True

    async def _assignment(
        self, scope: Any, receive: Any, send: Any, who: Principal, _: str, raw: bytes
    ) -> bool:
        body = _parse(wire.AssignmentRequest, raw)
        if body is None or not who.may_lease() or lease_refusal(who, body) is not None:
            return False
        self._route(scope, ASSIGNMENT_ROUTE)
        planner, state, holder, witness = self.state.planner, self.state, who.holder, who.witness

        def step(s: Any) -> Any:
            # the clock is read under the write lock
            answer = planner.assign_in(s, body, None, holder, witness)
            return lambda: leased(state, body, answer)

        return await self._answer(scope, receive, send, step, 201)

    async def _report(
        self, scope: Any, receive: Any, send: Any, who: Principal, lid: str, raw: bytes
    ) -> bool:
        body = _parse(wire.TransferReport, raw)
        if body is None or not who.may_lease():
            return False
        self._route(scope, REPORT_ROUTE)
        planner, state, by = self.state.planner, self.state, reporter(who)

        def step(s: Any) -> Any:
            out = planner.report_in(s, lid, body, None, by)
            return lambda: finished(state, body, out)

        return await self._answer(scope, receive, send, step, 200)

    async def _answer(self, scope: Any, receive: Any, send: Any, step: Step, status: int) -> bool:
        """Run a write in a batch (planner.writes) and send its answer; False: fall through (another
        holder's lease: the app's 403; any other error rolled back and the app runs it again)."""
        try:
            out = await self.writes.run(step)
        except Exception:  # noqa: BLE001 - rolled back; the app runs it again and answers as documented
            log.debug("hot path: %s falls through to the app", scope["path"], exc_info=True)
            return False
        if isinstance(out, PlannerError):
            await planner_error_response(out)(scope, receive, send)
            return True
        if isinstance(out, Exception):
            return False
        await _send_json(send, status, dump_json(out))
        return True


def _hex_between(path: str, prefix: str, suffix: str) -> bool:
    """`path` is prefix + 32 lowercase hex digits + suffix (an id as the routes' path pattern)."""
    return (
        len(path) == len(prefix) + 32 + len(suffix)
        and path.startswith(prefix)
        and path.endswith(suffix)
        and _HEX.issuperset(path[len(prefix) : len(prefix) + 32])
    )


async def _read_json_body(scope: Any, receive: Any) -> bytes | None:
    """The body of a JSON request that declared its length (the caller checked it against the limit;
    the HTTP server delivers exactly that many bytes); None: not JSON, or the client left."""
    declared = content_type = None
    for name, value in scope["headers"]:
        if name == b"content-length":
            declared = value
        elif name == b"content-type":
            content_type = value
    if declared is None or content_type is None or content_type.split(b";")[0].strip().lower() != _JSON:
        return None
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None  # the client left; the app sees the same disconnect
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return bytes(body)


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    """`raw` as the route would validate it (JSON, then the model in Python mode), or None: the app
    answers (orjson refuses whatever json.loads might read differently: NaN, huge integers, lone
    surrogates; those fall through to the app's own parsing)."""
    try:
        return model.model_validate(orjson.loads(raw))
    except (orjson.JSONDecodeError, ValidationError):
        return None


async def _send_json(send: Any, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", _JSON), (b"content-length", b"%d" % len(body))],
        }
    )
    await send({"type": "http.response.body", "body": body})
