"""Prometheus metrics of one planner app (own registry, so several apps can share a process).

With `rfork planner serve --workers N` every worker process counts its own requests; the command sets
PROMETHEUS_MULTIPROC_DIR (a fresh directory) before the workers start, prometheus_client then keeps
each process's values in files there, and /metrics reads them all (`MultiProcessCollector`): the
figures are the fleet's, whichever process answers the scrape, and carry no `_created` series. The
gauges are read from the database at scrape time, so the most recent scrape's value is the one shown.
"""

from __future__ import annotations

import os
import time
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class PlannerMetrics:
    """The counters and gauges /metrics exposes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess = bool(os.environ.get(MULTIPROC_ENV))
        self.requests = Counter(
            "rfork_planner_requests_total",
            "HTTP requests",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "rfork_planner_request_seconds",
            "HTTP request latency",
            ["route"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.assignments = Counter(
            "rfork_planner_assignments_total", "assignment answers", ["result"], registry=self.registry
        )
        self.transfers = Counter(
            "rfork_planner_transfers_total", "transfer reports", ["outcome"], registry=self.registry
        )
        self.transfer_bytes = Counter(
            "rfork_planner_transfer_bytes_total", "bytes reported moved", registry=self.registry
        )
        self.instances = Gauge(
            "rfork_planner_instances",
            "instances by status",
            ["status"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.live_leases = Gauge(
            "rfork_planner_live_leases",
            "leases not ended nor expired",
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.integrity_refusals = Counter(
            "rfork_planner_integrity_refusals_total",
            "manifests refused because their digests differ from the identity's anchored set",
            registry=self.registry,
        )
        self.anchors = Counter(
            "rfork_planner_anchors_total",
            "digest sets anchored (first disk-loaded publication of an identity's rank)",
            registry=self.registry,
        )
        self.quarantined = Gauge(
            "rfork_planner_quarantined_seeds",
            "seeds out of service: cause reports (distinct reporters), probe (failed health probe), "
            "accused (a checksum report awaits an independent verification), integrity (refused digests)",
            ["cause"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.flagged_reporters = Gauge(
            "rfork_planner_flagged_reporters",
            "reporters with false_report_threshold disproved checksum claims (their claims are ignored)",
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.reporter_disproved = Gauge(
            "rfork_planner_reporter_disproved_claims",
            "disproved checksum claims of each flagged reporter",
            ["reporter"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.reaped = Counter(
            "rfork_planner_reaped_total", "reaper actions", ["kind"], registry=self.registry
        )

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of /metrics: this process's registry, or every worker's values when the
        planner runs as several processes (see the module docstring)."""
        if not self.multiprocess:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        merged = CollectorRegistry()
        MultiProcessCollector(merged)
        return generate_latest(merged), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Pure ASGI middleware: counts requests and times them by route template."""

    def __init__(self, app: Any, metrics: PlannerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Wrap one request."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def _send(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            self.metrics.requests.labels(method=scope["method"], route=path, status=str(status[0])).inc()
            self.metrics.latency.labels(route=path).observe(time.perf_counter() - start)
