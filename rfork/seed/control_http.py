"""The HTTP side of a seed's control endpoint: parse and answer requests for `rfork.seed.control`.

Requests are parsed and bounded here (Content-Length required, bodies capped at 64 KiB, a socket
timeout per connection) and answered as JSON; what they mean (auth, sessions) is the control
server's. Bad input answers 4xx with {"error": message}.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol

logger = logging.getLogger(__name__)

_MAX_BODY = 64 << 10


class HttpError(Exception):
    """An answer other than success: its status and JSON body ({"error": message, ...})."""

    def __init__(self, status: HTTPStatus, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.body: dict[str, Any] = {"error": message, **extra}


class Session(Protocol):
    """A session as the handler shows it."""

    session_id: str
    port: int
    backend: str

    def to_json(self) -> dict[str, Any]: ...


class Control(Protocol):
    """What the handler asks of the control server (rfork.seed.control.ControlServer)."""

    def health(self) -> dict[str, Any]: ...

    def session(self, session_id: str) -> Session | None: ...

    def authorize(self, rank: int, authorization: str | None) -> None: ...

    def open_session(self, rank: int, local_host: str) -> Session: ...


def handler_for(control: Control, timeout_s: float) -> type[BaseHTTPRequestHandler]:
    """A handler class bound to `control`, with a per-connection socket timeout of `timeout_s`."""
    return type("_BoundHandler", (_Handler,), {"control": control, "timeout": timeout_s})


class _Handler(BaseHTTPRequestHandler):
    control: Control
    protocol_version = "HTTP/1.1"
    server_version = "rfork-control/1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        logger.debug("control %s: %s", self.address_string(), format % args)

    def _reply(self, status: HTTPStatus, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _fail(self, err: HttpError) -> None:
        headers = {}
        if err.status == HTTPStatus.TOO_MANY_REQUESTS:
            headers["Retry-After"] = "1"
        self._reply(err.status, err.body, headers)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/v1/health":
            self._reply(HTTPStatus.OK, self.control.health())
            return
        prefix = "/v1/nccl/sessions/"
        if path.startswith(prefix):
            info = self.control.session(path[len(prefix) :])
            if info is None:
                self._fail(HttpError(HTTPStatus.NOT_FOUND, f"no session {path[len(prefix) :]!r}"))
            else:
                self._reply(HTTPStatus.OK, info.to_json())
            return
        self._fail(HttpError(HTTPStatus.NOT_FOUND, f"no such path {path!r}"))

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path != "/v1/nccl/sessions":
            self._fail(HttpError(HTTPStatus.NOT_FOUND, f"no such path {path!r}"))
            return
        try:
            rank = self._read_rank()
            self.control.authorize(rank, self.headers.get("Authorization"))
            info = self.control.open_session(rank, str(self.connection.getsockname()[0]))
        except HttpError as err:
            self._fail(err)
            return
        host = str(self.connection.getsockname()[0])
        self._reply(
            HTTPStatus.CREATED,
            {"session_id": info.session_id, "host": host, "port": info.port, "backend": info.backend},
        )

    def do_PUT(self) -> None:
        self._fail(HttpError(HTTPStatus.METHOD_NOT_ALLOWED, f"PUT not allowed on {self.path!r}"))

    do_DELETE = do_PUT
    do_PATCH = do_PUT

    def _read_rank(self) -> int:
        raw_len = self.headers.get("Content-Length")
        if raw_len is None:
            raise HttpError(HTTPStatus.LENGTH_REQUIRED, "Content-Length required")
        try:
            length = int(raw_len)
        except ValueError as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {raw_len!r}") from exc
        if length < 0 or length > _MAX_BODY:
            self.close_connection = True
            raise HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {length} bytes; limit {_MAX_BODY}")
        try:
            raw = self.rfile.read(length)
        except (TimeoutError, OSError) as exc:
            self.close_connection = True
            raise HttpError(
                HTTPStatus.REQUEST_TIMEOUT, f"body not received within the timeout: {exc}"
            ) from exc
        try:
            body = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise HttpError(HTTPStatus.BAD_REQUEST, 'body must be a JSON object like {"rank": 0}')
        rank = body.get("rank")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise HttpError(
                HTTPStatus.UNPROCESSABLE_ENTITY, f"field 'rank' must be a non-negative integer, got {rank!r}"
            )
        return rank
