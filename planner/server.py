"""PlannerServer: the planner in a background thread (uvicorn), for tests and the demo."""

from __future__ import annotations

import logging
import socket
import threading
import time
from types import TracebackType
from typing import Any

from planner.db import migrate
from planner.errors import PlannerUnavailable
from planner.settings import PlannerSettings

log = logging.getLogger(__name__)


class PlannerServer:
    """Migrates `db_url`, then serves the planner on host:port (port 0 picks a free one) until closed.

    Extra keyword arguments are PlannerSettings fields (admin_token, heartbeat_ttl_s, ...).
    """

    def __init__(
        self,
        db_url: str = "sqlite:///rfork-planner.db",
        host: str = "127.0.0.1",
        port: int = 0,
        insecure: bool = True,
        *,
        start_timeout_s: float = 30.0,
        **settings: Any,
    ) -> None:
        self.settings = PlannerSettings(db_url=db_url, insecure=insecure, **settings)
        self.host = host
        self.port = port
        self.start_timeout_s = start_timeout_s
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.app: Any = None

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:8642."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> PlannerServer:
        """Migrate, bind and serve; returns once the server accepts connections."""
        import uvicorn

        from planner.app import create_app

        migrate(self.settings.db_url)
        self.app = create_app(self.settings)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name=f"planner-{self.port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise PlannerUnavailable(f"planner on {self.url} did not start")
            time.sleep(0.01)
        log.info("planner serving on %s (db %s)", self.url, self.settings.db_url.split("@")[-1])
        return self

    def close(self) -> None:
        """Stop serving and join the thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = self._thread = None

    def __enter__(self) -> PlannerServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
