"""One HTTP/1.1 request from a loader to a seed's control endpoint, bounded as a whole.

A seed is a peer: it may answer a byte at a time, send without end, or name an address it should not
(rfork.seed_networks). Client libraries bound each read, so a seed dripping a byte per second holds a
loader for as long as it likes. Here the deadline covers the whole request (resolve, connect, send,
headers, body: every socket operation waits at most what is left of it) and the cap covers every byte
received, headers included. Plain sockets and h11 (the parser the seed's endpoint uses); http only.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

import h11

from rfork.seed_networks import resolve_seed_host

T = TypeVar("T")
_HEAD_BYTES = 64 * 1024  # status line and headers


class SeedRequestError(OSError):
    """The request to a seed failed, ran past its deadline, exceeded its size cap, or was not allowed."""


@dataclass(frozen=True)
class SeedResponse:
    """A seed's complete answer (header names lower-case)."""

    status: int
    headers: dict[str, str]
    body: bytes


def seed_request(
    method: str,
    url: str,
    *,
    timeout_s: float,
    max_body_bytes: int,
    headers: Mapping[str, str] | None = None,
    body: bytes = b"",
) -> SeedResponse:
    """Send one request and read the whole answer within `timeout_s` and `max_body_bytes`.

    SeedRequestError names the url and what went wrong; the connection is always closed.
    """
    if timeout_s <= 0 or max_body_bytes < 0:
        raise ValueError(f"timeout_s must be > 0 and max_body_bytes >= 0, got {timeout_s}, {max_body_bytes}")
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise SeedRequestError(f"{url}: only http://host:port URLs name a seed endpoint")
    deadline = time.monotonic() + timeout_s
    try:
        port = parts.port or 80
    except ValueError as exc:
        raise SeedRequestError(f"{url}: {exc}") from exc
    addrs = resolve_seed_host(parts.hostname, port)  # SeedNetworkRefused (an OSError) when not allowed
    sock = _connect(url, addrs, deadline)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=_HEAD_BYTES)
        head = [("Host", parts.netloc), ("Connection", "close"), ("Content-Length", str(len(body)))]
        head += [(k, v) for k, v in (headers or {}).items()]
        out = conn.send(h11.Request(method=method, target=target, headers=head)) or b""
        out += (conn.send(h11.Data(data=body)) or b"") if body else b""
        out += conn.send(h11.EndOfMessage()) or b""
        _io(url, deadline, lambda: sock.sendall(out), sock)
        return _receive(url, conn, sock, deadline, max_body_bytes)
    except h11.ProtocolError as exc:
        raise SeedRequestError(f"{url}: not a valid HTTP answer ({exc})") from exc
    finally:
        sock.close()


def _connect(url: str, addrs: list[tuple[str, int]], deadline: float) -> socket.socket:
    errors = []
    for addr in addrs:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            return socket.create_connection(addr, timeout=left)
        except OSError as exc:
            errors.append(f"{addr[0]}: {exc}")
    raise SeedRequestError(f"{url}: cannot connect ({'; '.join(errors) or 'deadline passed'})")


def _receive(url: str, conn: h11.Connection, sock: socket.socket, deadline: float, cap: int) -> SeedResponse:
    status, size = 0, 0
    headers: dict[str, str] = {}
    parts: list[bytes] = []
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = _io(url, deadline, lambda: sock.recv(65536), sock)
            conn.receive_data(data)  # b"": the seed closed (h11 then ends or raises)
        elif isinstance(event, h11.Response):
            status = event.status_code
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
            declared = headers.get("content-length", "")
            if declared.isascii() and declared.isdigit() and int(declared) > cap:
                raise SeedRequestError(f"{url}: answer of {declared} bytes over the {cap}-byte limit")
        elif isinstance(event, h11.Data):
            size += len(event.data)
            if size > cap:
                raise SeedRequestError(f"{url}: answer over the {cap}-byte limit")
            parts.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return SeedResponse(status=status, headers=headers, body=b"".join(parts))
        elif isinstance(event, h11.ConnectionClosed):
            raise SeedRequestError(f"{url}: the seed closed the connection before the answer ended")
        # h11.InformationalResponse (100 Continue): nothing to keep


def _io(url: str, deadline: float, op: Callable[[], T], sock: socket.socket) -> T:
    """Run one socket operation with what is left of the deadline."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise SeedRequestError(f"{url}: no complete answer within the deadline")
    sock.settimeout(left)
    try:
        return op()
    except TimeoutError as exc:
        raise SeedRequestError(f"{url}: no complete answer within the deadline") from exc
    except OSError as exc:
        raise SeedRequestError(f"{url}: {exc}") from exc
