"""PlannerServer: the planner in a background thread (uvicorn), for tests and the demo.

It binds the port it is given (0: a free one); `rfork planner serve`, the production way to run the
planner, listens on 8470 by default (planner.settings.DEFAULT_PORT).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn
from fastapi import FastAPI

from planner.app import create_app
from planner.contract.errors import PlannerUnavailable
from planner.db import migrate
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
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app: FastAPI | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:8470 (`rfork planner serve`'s default port, DEFAULT_PORT)."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> PlannerServer:
        """Migrate, bind and serve; returns once the server accepts connections."""
        migrate(self.settings.db_url)
        self.app = create_app(self.settings)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="on")
        server = self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name=f"planner-{self.port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not server.started:
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
        self._server = None
        self._thread = None

    def __enter__(self) -> PlannerServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
