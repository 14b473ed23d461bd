"""Prometheus metrics of a loader and a seed: what an operator of a fleet watches per instance.

A load counts its rank pulls by source and outcome, the bytes each source gave, its fallbacks by
reason and the time spent verifying digests; a seed counts its heartbeat failures and says what it
serves. The counters live in rfork's own registry (not prometheus_client's default one: a framework
that embeds rfork keeps its own /metrics as it was); `serve_metrics` exposes them on a port
(`rfork load|seed --metrics-port`, docs/operations.md). Counting costs a lock and an add, with or
without a scraper.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

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

_server_lock = threading.Lock()
_server: Any = None


def serve_metrics(port: int, host: str = "0.0.0.0") -> int:
    """Expose the registry as Prometheus text on http://HOST:PORT/metrics (a daemon thread; once per
    process); returns the port (useful with 0). OSError when the port is taken."""
    global _server
    with _server_lock:
        if _server is None:
            server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
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
