"""The planner's PostgreSQL goes away: every route answers 503 with Retry-After (no traceback), /metrics
still answers, and the planner serves again once the database is back.

The database is the session's real PostgreSQL, reached through a TCP relay in this process; stopping
the relay (and cutting its connections) is the database going down as the planner sees it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

from planner import PlannerServer, migrate
from tests.planner.conftest import identity

pytestmark = pytest.mark.postgres


class Relay:
    """Test double for a network path to the database: forwards 127.0.0.1:<port> to `target` until
    `stop()`, which closes the listener and every relayed connection."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        with contextlib.suppress(OSError):  # wakes the accept (close alone leaves it listening)
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self._lock:
            for s in self._conns:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            self._conns.clear()

    def start_again(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()


@pytest.fixture
def relayed(postgres_url: str) -> Iterator[tuple[str, Relay]]:
    migrate(postgres_url)
    parts = urlsplit(postgres_url)
    relay = Relay((parts.hostname or "127.0.0.1", parts.port or 5432))
    netloc = f"{parts.username}@127.0.0.1:{relay.port}" if parts.username else f"127.0.0.1:{relay.port}"
    yield urlunsplit(parts._replace(netloc=netloc)), relay
    relay.stop()


RANK0 = {"rank": 0, "provider": "tcp", "address": "YWI="}
ROUTES = [
    ("GET", "/readyz", None),
    ("GET", "/v1/instances", None),
    ("POST", "/v1/instances", {"identity": identity(), "ranks": [RANK0]}),
    ("POST", "/v1/assignments", {"identity": identity(), "rank": 0}),
    ("POST", "/v1/instances/0123456789abcdef0123456789abcdef/heartbeat", None),
    ("GET", "/v1/anchors", None),
    ("GET", "/v1/fleet", None),
    ("GET", "/v1/models", None),
]


TOKENS = [None, "down-admin", "rfi_" + "x" * 43]  # rfi_: an instance token, looked up in the database


@pytest.mark.parametrize("token", TOKENS, ids=["insecure", "admin", "instance"])
def test_every_route_answers_503_while_the_database_is_down(
    relayed: tuple[str, Relay], caplog: pytest.LogCaptureFixture, token: str | None
) -> None:
    url, relay = relayed
    auth: dict[str, Any] = {} if token is None else {"admin_token": "down-admin", "insecure": False}
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    with PlannerServer(db_url=url, port=0, reaper_interval_s=3600, **auth) as srv, httpx.Client(
        base_url=srv.url, timeout=60, headers=headers
    ) as http:
        assert http.get("/readyz").status_code == 200
        relay.stop()
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            for method, path, body in ROUTES:
                r = http.request(method, path, json=body)
                assert r.status_code == 503, (method, path, r.status_code, r.text[:300])
                assert int(r.headers["retry-after"]) >= 1, (method, path)
                if path != "/readyz":
                    assert "database" in r.json()["detail"], (method, path)
                # an unauthenticated caller learns nothing of the database: no host, port or role
                for secret in ("127.0.0.1", str(relay.port), f'"{urlsplit(url).username}"', "port"):
                    assert secret not in r.text, (method, path, r.text)
            metrics = http.get("/metrics")
            assert metrics.status_code == 200
            assert "rfork_planner" in metrics.text
        assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
        relay.start_again()
        assert http.get("/readyz").status_code == 200
