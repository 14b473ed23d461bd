"""`rfork planner serve`'s socket and server: bind first, then say where, then serve.

The port is bound here, before uvicorn starts, so the address printed is the real one (`--port 0`
picks a free port and prints it), a taken port is one line instead of uvicorn's raw errno and status
3, and every worker of `--workers N` serves the one socket. A database that cannot be reached is one
line too (`database_problem`), not a driver's multi-line dump.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import tempfile
from typing import Any

from rfork.cli import signals


class ServeError(RuntimeError):
    """The planner cannot start here (port, database); the message is the one line to print."""


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket on host:port (port 0: a free one); ServeError naming the fix."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ServeError(
                f"port {port} on {host} is already in use (another planner?): pick another --port, "
                "or stop what holds it"
            ) from None
        raise ServeError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} (check --host and --port)"
        ) from None
    sock.set_inheritable(True)  # --workers N: the worker processes serve this socket
    return sock


def address(sock: socket.socket) -> str:
    """http://HOST:PORT of a bound socket (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def database_problem(exc: BaseException, url: str) -> ServeError:
    """One line for a database that cannot be reached or used (password hidden)."""
    # imported here: `rfork --help` imports every command module (start-up time)
    from planner import redact_url

    shown = redact_url(url)
    cause = getattr(exc, "orig", None) or exc
    first = next((line.strip() for line in str(cause).splitlines() if line.strip()), type(cause).__name__)
    return ServeError(f"database {shown}: {first} (check --db or $RFORK_DB_URL, and that the database is up)")


def serve(app: Any, *, sock: socket.socket, workers: int) -> str | None:
    """Run uvicorn on `sock` until SIGINT or SIGTERM, then shut down gracefully (the requests in flight
    are answered): `app` itself, or with workers > 1 the factory `planner.app:app_from_env` in each
    worker process, their metrics merged (planner.metrics). Returns the stopping signal's name.

    uvicorn catches the signal while it serves and raises it again once it has stopped; the handler set
    here receives that, so the command ends with its status 0 and one line, not killed by the signal."""
    # imported here: `rfork --help` imports every command module (start-up time)
    import uvicorn

    stopped: list[int] = []
    signals.install(lambda signum, _frame: stopped.append(signum))
    if workers <= 1:
        config = uvicorn.Config(app, log_level="warning", access_log=False)
        uvicorn.Server(config).run(sockets=[sock])
        return signal.Signals(stopped[0]).name if stopped else None
    from uvicorn.supervisors import Multiprocess

    with tempfile.TemporaryDirectory(prefix="rfork-planner-metrics-") as metrics_dir:
        # prometheus_client's multiprocess mode, read by planner.metrics: set before the workers import it
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        config = uvicorn.Config(
            "planner.app:app_from_env", factory=True, workers=workers, log_level="warning", access_log=False
        )
        Multiprocess(config, sockets=[sock]).run()
    return signal.Signals(stopped[0]).name if stopped else None
