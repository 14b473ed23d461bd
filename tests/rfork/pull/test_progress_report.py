"""A loader's progress reports to the planner: the read loop only stores the figure, a helper thread
posts the latest, a refused report is dropped with one warning and never reaches the pull."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from planner import PlannerServer
from planner.contract import PlannerClient
from rfork.pull.progress_report import JOIN_TIMEOUT_S, PullProgress
from tests.planner.conftest import empty_database, identity, manifest, ranks
from tests.waiting import wait_until


@pytest.fixture
def planner_url(db_url: str) -> str:
    return empty_database(db_url)


def _leased(url: str) -> tuple[PlannerClient, str]:
    admin = PlannerClient(url, token="adm")
    reg = admin.register_instance(identity=identity(), ranks=ranks(0, 1))
    admin.put_manifest(reg.id, 0, manifest(0))
    admin.set_status(reg.id, "READY")
    loader = PlannerClient(url, token="load")
    lease = loader.request_assignment(identity=identity(), rank=0)
    assert lease is not None
    return loader, lease.id


def _fleet_bytes(url: str) -> int | None:
    edges = PlannerClient(url, token="read").fleet().edges
    return edges[0].bytes_done if edges and edges[0].live else None


def test_latest_figure_reaches_the_planner_and_the_callers_own_callback(planner_url):
    with PlannerServer(
        db_url=planner_url, port=0, admin_token="adm", load_token="load", reader_token="read"
    ) as srv:
        loader, lease_id = _leased(srv.url)
        seen: list[tuple[int, int]] = []
        reporter = PullProgress(loader, lease_id, forward=lambda d, t: seen.append((d, t)), interval_s=0.05)
        t0 = time.perf_counter()
        for done in range(0, 64_001, 64):
            reporter(done, 64_000)
        per_call = (time.perf_counter() - t0) / 1001
        assert len(seen) == 1001  # the caller's callback sees every call
        assert per_call < 1e-3  # no HTTP in the caller's thread
        wait_until(lambda: _fleet_bytes(srv.url) == 64_000, 10, "the last progress reached the fleet view")
        reporter.close()
        assert not any(t.name == "rfork-pull-progress" for t in threading.enumerate())


def test_a_refused_report_is_dropped_with_one_warning(planner_url, caplog):
    with PlannerServer(
        db_url=planner_url, port=0, admin_token="adm", load_token="load", reader_token="read"
    ) as srv:
        loader, lease_id = _leased(srv.url)
        loader.report_transfer(lease_id, outcome="success", bytes=64, seconds=0.1)  # the lease has ended
        reporter = PullProgress(loader, lease_id, interval_s=0.05)
        with caplog.at_level(logging.WARNING, logger="rfork.pull.progress_report"):
            for done in range(10):
                reporter(done, 10)
                time.sleep(0.03)
            reporter.close()
        warnings = [r for r in caplog.records if "not reported" in r.getMessage()]
        assert len(warnings) == 1


def test_a_planner_that_never_answers_does_not_hold_up_the_pull(caplog):
    """A listener that accepts and never answers (a hung planner): close() returns within its bound."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        client = PlannerClient(f"http://127.0.0.1:{hung.getsockname()[1]}", token="load")
        reporter = PullProgress(client, "0" * 32, interval_s=0.05)
        with caplog.at_level(logging.DEBUG, logger="rfork.pull.progress_report"):
            reporter(1, 2)
            hung.settimeout(10)
            conn, _ = hung.accept()
            with conn:
                assert conn.recv(1)  # the post is in flight, waiting on the silent peer
                t0 = time.monotonic()
                reporter.close()
                assert time.monotonic() - t0 < JOIN_TIMEOUT_S + 0.5
        client.close()
