"""Prometheus metrics of a loader and a seed: what an operator of a fleet watches per instance.

A load counts its rank pulls by source and outcome, the bytes each source gave, its fallbacks by
reason and the time spent verifying digests; a seed counts its heartbeat failures and says what it
serves. The counters live in rfork's own registry (not prometheus_client's default one: a framework
that embeds rfork keeps its own /metrics as it was); `serve_metrics` exposes them on a port
(`rfork load|seed --metrics-port`, docs/operations.md). Counting costs a lock and an add, with or
without a scraper. The port binds 127.0.0.1 unless told otherwise; it serves at most
`MAX_CONNECTIONS` connections at once (one thread each; more are closed at once) and closes one
that sends nothing for `IDLE_TIMEOUT_S`, so idle or dripping connections cannot pile up threads in
the serving process.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import sys
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry(auto_describe=True)

PULLS = Counter(
    "rfork_pulls_total",
    "rank loads by source (rfork-tcp, nccl, disk, ...) and outcome (success, failure, aborted)",
    ["source", "outcome"],
    registry=REGISTRY,
)
PULL_BYTES = Counter("rfork_pull_bytes_total", "bytes loaded, by source", ["source"], registry=REGISTRY)
PULL_SECONDS = Histogram(
    "rfork_pull_seconds",
    "seconds per successful rank load, by source",
    ["source"],
    registry=REGISTRY,
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
VERIFY_SECONDS = Histogram(
    "rfork_verify_seconds",
    "seconds of digest work per verified rank pull (mostly overlapped with the transfer)",
    registry=REGISTRY,
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
FALLBACKS = Counter(
    "rfork_fallbacks_total",
    "ranks that did not come from a seed, by reason (planner_unreachable, no_seed, not_anchored, all_busy, "
    "pulls_failed, no_planner)",
    ["reason"],
    registry=REGISTRY,
)
SEED_BYTES = Gauge("rfork_seed_bytes", "bytes this process serves as a seed", registry=REGISTRY)
SEED_INSTANCES = Gauge(
    "rfork_seed_instances", "planner instances this process publishes as a seed", registry=REGISTRY
)
SEED_HEARTBEAT_FAILURES = Counter(
    "rfork_seed_heartbeat_failures_total",
    "heartbeats or re-publications that failed (planner unreachable or refusing)",
    registry=REGISTRY,
)

DEFAULT_HOST = "127.0.0.1"
MAX_CONNECTIONS = 8
IDLE_TIMEOUT_S = 5.0

_server_lock = threading.Lock()
_server: Any = None


class _Handler(WSGIRequestHandler):
    """One connection; its socket times out after IDLE_TIMEOUT_S without a byte, ending its thread."""

    timeout = IDLE_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Scrapes are not logged."""


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    """A thread per connection, at most MAX_CONNECTIONS of them: a connection over that is closed."""

    daemon_threads = True
    request_queue_size = 128  # a burst of connections is accepted (and refused or served) at once

    def __init__(self, address: tuple[str, int]) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that timed out or broke: one debug line, not a traceback on stderr."""
        log.debug("metrics connection from %s ended: %s", client_address, sys.exc_info()[1])

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve_metrics(port: int, host: str = DEFAULT_HOST) -> int:
    """Expose the registry as Prometheus text on http://HOST:PORT/metrics (a daemon thread; once per
    process); returns the port (useful with 0). OSError when the port is taken."""
    global _server
    with _server_lock:
        if _server is None:
            server = _Server((host, port))
            server.set_app(make_wsgi_app(REGISTRY))
            threading.Thread(target=server.serve_forever, name="rfork-metrics", daemon=True).start()
            _server = server
        bound = int(_server.server_address[1])
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound


def pull_finished(*, source: str, outcome: str, nbytes: int = 0, seconds: float = 0.0) -> None:
    """Count one rank's load from `source` (`outcome`: success, failure, aborted)."""
    PULLS.labels(source=source, outcome=outcome).inc()
    if outcome == "success":
        PULL_BYTES.labels(source=source).inc(nbytes)
        PULL_SECONDS.labels(source=source).observe(seconds)


def fell_back(reason: str) -> None:
    """Count one rank that did not come from a seed, and why."""
    FALLBACKS.labels(reason=reason).inc()
