"""One bounded HTTP/1.1 exchange with a seed's control endpoint: a total deadline and a size cap.

A seed is a peer, not an authority: it may drip its answer a byte at a time (a per-read timeout then
never fires) or send an endless body. Every request a loader or the planner makes to a seed goes
through `exchange`, which fails with SeedHttpError once `deadline_s` has passed since the call began,
however the bytes arrive, or once the answer's head or body exceeds its cap. h11 parses the answer;
one connection per request (the seed closes every connection after its answer). Used by
rfork.pull.nccl (the session request), rfork.compile_cache.fetch (the archive) and the planner's
health probe of a seed. `resolve` lets a loader check where it connects (rfork.seed_networks).
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11

MAX_HEAD_BYTES = 16 << 10  # status line and headers
DEFAULT_MAX_BODY_BYTES = 64 << 10  # a control answer is a small JSON object


class SeedHttpError(OSError):
    """A seed's answer did not arrive whole within the deadline and caps (or the connection failed).

    An OSError, so callers that handled a failed connection handle this too."""


@dataclass(frozen=True)
class SeedAnswer:
    """A seed's answer: status code, headers (lower-case names) and the whole body."""

    status: int
    headers: dict[str, str]
    body: bytes


def exchange(
    url: str,
    *,
    method: str = "GET",
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    deadline_s: float,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    resolve: Callable[[str, int], list[tuple[str, int]]] | None = None,
) -> SeedAnswer:
    """`method url` with `body`; the whole answer within `deadline_s` seconds of this call, at most
    `max_body_bytes` of body (a declared Content-Length above it fails before the body is read).

    `resolve(host, port)` gives the addresses to try in order (default: the host as given); what it
    raises (a refused network) passes through unchanged. Raises SeedHttpError naming the URL and
    what was exceeded.
    """
    if deadline_s <= 0:
        raise ValueError(f"deadline_s must be positive, got {deadline_s}")
    end = time.monotonic() + deadline_s
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SeedHttpError(f"{url}: not an http(s)://host[:port] URL")
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    head = {"Host": parts.netloc, "Connection": "close", "Content-Length": str(len(body))}
    head.update(headers or {})
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
    addrs = resolve(host, port) if resolve is not None else [(host, port)]
    try:
        sock = _connect(addrs, end, url)
        if parts.scheme == "https":
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
    except OSError as exc:
        if isinstance(exc, SeedHttpError):
            raise
        raise SeedHttpError(f"{url}: cannot connect: {exc}") from exc
    with sock:
        try:
            request = h11.Request(method=method, target=target, headers=list(head.items()))
            data = conn.send(request) + (conn.send(h11.Data(data=body)) if body else b"")
            data += conn.send(h11.EndOfMessage())
            sock.settimeout(_left(end, url, "send"))
            sock.sendall(data)
            return _read_answer(conn, sock, end, url, max_body_bytes)
        except h11.RemoteProtocolError as exc:
            raise SeedHttpError(f"{url}: malformed answer: {exc}") from exc
        except TimeoutError as exc:
            raise SeedHttpError(f"{url}: no whole answer within the {deadline_s:g} s deadline") from exc
        except SeedHttpError:
            raise
        except OSError as exc:
            raise SeedHttpError(f"{url}: {exc}") from exc


def _connect(addrs: list[tuple[str, int]], end: float, url: str) -> socket.socket:
    """The first address that accepts, each try within what is left of the deadline."""
    errors = []
    for addr in addrs:
        try:
            return socket.create_connection(addr, timeout=_left(end, url, "connect"))
        except SeedHttpError:
            break
        except OSError as exc:
            errors.append(f"{addr[0]}: {exc}")
    raise SeedHttpError(f"{url}: cannot connect: {'; '.join(errors) or 'deadline passed'}")


def _read_answer(conn: h11.Connection, sock: socket.socket, end: float, url: str, cap: int) -> SeedAnswer:
    """Events until the answer ends; each recv waits at most until the overall deadline."""
    status, headers, chunks, size = 0, {}, [], 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            sock.settimeout(_left(end, url, "answer"))
            conn.receive_data(sock.recv(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
            declared = headers.get("content-length", "")
            if declared.isascii() and declared.isdigit() and int(declared) > cap:
                raise SeedHttpError(f"{url}: answer body of {declared} bytes exceeds the cap of {cap}")
        elif isinstance(event, h11.Data):
            size += len(event.data)
            if size > cap:
                raise SeedHttpError(f"{url}: answer body exceeds the cap of {cap} bytes")
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return SeedAnswer(status=status, headers=headers, body=b"".join(chunks))
        elif isinstance(event, h11.ConnectionClosed):
            raise SeedHttpError(f"{url}: connection closed before the answer ended")
        # h11.InformationalResponse (1xx): keep reading


def _left(end: float, url: str, phase: str) -> float:
    """Seconds left before the deadline; SeedHttpError once it has passed."""
    left = end - time.monotonic()
    if left <= 0:
        raise SeedHttpError(f"{url}: deadline passed during {phase}")
    return left
