"""The HTTP side of a seed's control endpoint: a bounded server that parses and answers requests.

It runs inside the inference process, so a hostile or broken client must cost it little:
- one asyncio loop on one thread reads every connection (h11 parses HTTP/1.1), so a connection that
  drips bytes holds a socket and a few KiB, never a thread;
- every request has one deadline from accept to the last byte of the answer (408 when it runs out);
- at most ``max_connections`` are open: a new one evicts the oldest still sending its head, so
  dripping connections cannot crowd out a client that sends its head at once;
- the listen backlog (``backlog``) holds a burst of connects;
- a POST is authorised from its headers before its body is read (401/403 then close), and its body
  is capped at 64 KiB with Content-Length required;
- work that may block (opening a session) runs on ``workers`` threads, never on the loop.
Every answer is JSON and closes the connection; bad input answers 4xx with {"error": message}.
What requests mean (auth, sessions) is the control server's (rfork.seed.control).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Generic, Protocol, TypeVar

import h11

logger = logging.getLogger(__name__)

MAX_BODY = 64 << 10
_MAX_HEAD = 16 << 10
_READ_CHUNK = 8192
_SESSIONS = "/v1/nccl/sessions"
_COMPILE_CACHES = "/v1/compile-caches/"
_CACHE_KEY = re.compile(r"[0-9a-f]{64}")


class HttpError(Exception):
    """An answer other than success: its status and JSON body ({"error": message, ...})."""

    def __init__(self, status: HTTPStatus, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.body: dict[str, Any] = {"error": message, **extra}


@dataclass(frozen=True)
class Blob:
    """A binary answer: a compile-cache archive and its digest (``X-Rfork-Archive-Digest``)."""

    data: bytes
    digest: str


class Archive(Protocol):
    """A packed compile cache as the endpoint sends it (rfork.compile_cache.archive.PackedCache)."""

    @property
    def data(self) -> bytes: ...

    @property
    def digest(self) -> str: ...


class Session(Protocol):
    """A session as the endpoint shows it."""

    session_id: str
    port: int
    backend: str

    def to_json(self) -> dict[str, Any]: ...


G = TypeVar("G")


class Control(Protocol, Generic[G]):
    """What the endpoint asks of the control server (rfork.seed.control.ControlServer).

    ``authorize`` sees only the Authorization header (the body is not read yet) and returns a grant;
    ``open_session`` gets that grant with the rank from the body and may block (it runs on a worker).
    """

    def health(self) -> dict[str, Any]: ...

    def session(self, session_id: str) -> Session | None: ...

    def authorize(self, authorization: str | None) -> G: ...

    def open_session(self, grant: G, rank: int, local_host: str) -> Session: ...

    def compile_cache(self, grant: G, key: str) -> Archive: ...


@dataclass
class _Progress:
    """How far one connection got: its request head is in; its answer is written."""

    head_done: bool = False
    answered: bool = False


class ControlHttpServer:
    """Serves `control` on (host, port) from a background thread; see the module docstring for bounds."""

    def __init__(
        self,
        control: Control[Any],
        *,
        host: str,
        port: int,
        request_deadline_s: float,
        workers: int = 4,
        backlog: int = 1024,
        max_connections: int = 256,
    ) -> None:
        if request_deadline_s <= 0:
            raise ValueError(f"request_deadline_s must be positive, got {request_deadline_s}")
        if workers < 1 or backlog < 1 or max_connections < 1:
            raise ValueError("workers, backlog and max_connections must be >= 1")
        self.control = control
        self.request_deadline_s = request_deadline_s
        self.max_connections = max_connections
        self._sock = socket.create_server((host, port), backlog=backlog)
        self._sock.setblocking(False)
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="rfork-control-worker")
        self._loop = asyncio.new_event_loop()
        self._conns: OrderedDict[asyncio.Task[None], _Progress] = OrderedDict()
        self._ready = threading.Event()
        self._stopping: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="rfork-control-http", daemon=True)
        self.evicted = 0

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def open_connections(self) -> int:
        """Connections open now (read on the loop thread; approximate elsewhere)."""
        return len(self._conns)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("control endpoint did not start within 10 s")

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, drop open connections, and let running workers finish on their own."""
        if self._thread.is_alive() and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(timeout_s)
        self._executor.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(OSError):
            self._sock.close()

    # -- the loop thread ---------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._accept, sock=self._sock, limit=_MAX_HEAD)
        self._ready.set()
        async with server:
            await self._stopping.wait()
            server.close()
            tasks = list(self._conns)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._conns) >= self.max_connections:
            self._evict_one()
        progress = self._conns[task] = _Progress()
        try:
            await asyncio.wait_for(self._serve(progress, reader, writer), self.request_deadline_s)
        except asyncio.TimeoutError:  # TimeoutError itself only from Python 3.11
            if not progress.answered:
                self._answer_now(writer, HttpError(
                    HTTPStatus.REQUEST_TIMEOUT,
                    f"request not completed within {self.request_deadline_s:g} s",
                ))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:  # evicted for a newer connection, or the server is closing
            pass
        except Exception:
            logger.exception("control endpoint: unexpected error serving a connection")
        finally:
            self._conns.pop(task, None)
            writer.close()

    def _evict_one(self) -> None:
        """Close the oldest connection still sending its head (else the oldest), to admit a new one."""
        victim = next((t for t, p in self._conns.items() if not p.head_done), None)
        if victim is None:
            victim = next(iter(self._conns))
        self._conns.pop(victim, None)
        victim.cancel()
        self.evicted += 1

    @staticmethod
    def _answer_now(writer: asyncio.StreamWriter, err: HttpError) -> None:
        """Best effort, without waiting: queue an error answer on a connection about to close."""
        with contextlib.suppress(Exception):
            writer.write(_response_bytes(err.status, err.body))

    async def _serve(self, progress: _Progress, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        try:
            request = await _next_event(conn, reader)
            if not isinstance(request, h11.Request):
                return  # the client closed before sending a request
            progress.head_done = True
            status, body = await self._route(conn, reader, request, writer)
        except h11.RemoteProtocolError as exc:  # h11 hints 501 for what it cannot parse: still the client's
            hint = exc.error_status_hint
            status = HTTPStatus(hint) if 400 <= hint < 500 else HTTPStatus.BAD_REQUEST
            body = {"error": f"bad request: {exc}"}
        except HttpError as err:
            status, body = err.status, err.body
        progress.answered = True
        writer.write(_response_bytes(status, body))
        await writer.drain()

    async def _route(self, conn: h11.Connection, reader: asyncio.StreamReader, request: h11.Request,
                     writer: asyncio.StreamWriter) -> tuple[HTTPStatus, dict[str, Any] | Blob]:
        method = request.method.decode("ascii", "replace")
        path = request.target.decode("ascii", "replace").split("?", 1)[0].rstrip("/")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
        if method == "GET":
            if path == "/v1/health":
                return HTTPStatus.OK, self.control.health()
            if path.startswith(_COMPILE_CACHES):
                return HTTPStatus.OK, await self._compile_cache(path[len(_COMPILE_CACHES) :], headers)
            prefix = _SESSIONS + "/"
            if path.startswith(prefix):
                info = self.control.session(path[len(prefix) :])
                if info is None:
                    raise HttpError(HTTPStatus.NOT_FOUND, f"no session {path[len(prefix) :]!r}")
                return HTTPStatus.OK, info.to_json()
            raise HttpError(HTTPStatus.NOT_FOUND, f"no such path {path!r}")
        if method != "POST":
            raise HttpError(HTTPStatus.METHOD_NOT_ALLOWED, f"{method} not allowed on {path!r}")
        if path != _SESSIONS:
            raise HttpError(HTTPStatus.NOT_FOUND, f"no such path {path!r}")
        grant = self.control.authorize(headers.get("authorization"))  # before any byte of the body
        rank = _rank_of(await _read_body(conn, reader, headers))
        local_host = str(writer.get_extra_info("sockname")[0])
        loop = asyncio.get_running_loop()
        info = await loop.run_in_executor(self._executor, self.control.open_session, grant, rank, local_host)
        return HTTPStatus.CREATED, {
            "session_id": info.session_id, "host": local_host, "port": info.port, "backend": info.backend,
        }


    async def _compile_cache(self, key: str, headers: dict[str, str]) -> Blob:
        if not _CACHE_KEY.fullmatch(key):
            raise HttpError(HTTPStatus.NOT_FOUND, f"compile cache key {key[:80]!r}: expected 64 hex digits")
        grant = self.control.authorize(headers.get("authorization"))
        loop = asyncio.get_running_loop()
        archive = await loop.run_in_executor(self._executor, self.control.compile_cache, grant, key)
        return Blob(data=archive.data, digest=archive.digest)


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        data = await reader.read(_READ_CHUNK)
        conn.receive_data(data)  # b"" tells h11 the client closed


async def _read_body(conn: h11.Connection, reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    raw_len = headers.get("content-length")
    if raw_len is None:
        raise HttpError(HTTPStatus.LENGTH_REQUIRED, "Content-Length required")
    length = int(raw_len)  # h11 has checked that it is a non-negative integer
    if length > MAX_BODY:
        raise HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {length} bytes; limit {MAX_BODY}")
    parts: list[bytes] = []
    while True:
        event = await _next_event(conn, reader)
        if isinstance(event, h11.Data):
            parts.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return b"".join(parts)
        else:
            raise HttpError(HTTPStatus.BAD_REQUEST, "connection closed before the body was complete")


def _rank_of(raw: bytes) -> int:
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


def _response_bytes(status: HTTPStatus, body: dict[str, Any] | Blob) -> bytes:
    if isinstance(body, Blob):
        data = body.data
        extra = f"Content-Type: application/x-tar\r\nX-Rfork-Archive-Digest: {body.digest}\r\n"
    else:
        data, extra = json.dumps(body).encode(), "Content-Type: application/json\r\n"
    if status == HTTPStatus.TOO_MANY_REQUESTS:
        extra += "Retry-After: 1\r\n"
    head = (
        f"HTTP/1.1 {status.value} {status.phrase}\r\nServer: rfork-control/2\r\n"
        f"{extra}Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + data
