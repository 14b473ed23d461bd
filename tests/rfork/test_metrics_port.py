"""The loader/seed metrics port (rfork.metrics.serve_metrics): loopback unless told otherwise, and a
bounded number of threads whatever connections arrive (idle ones are closed)."""

from __future__ import annotations

import argparse
import socket
import threading

import pytest

from rfork import metrics
from rfork.cli.options import add_metrics
from tests.waiting import wait_until


def test_the_metrics_port_binds_loopback_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RFORK_METRICS_HOST", raising=False)
    parser = argparse.ArgumentParser()
    add_metrics(parser)
    assert parser.parse_args([]).metrics_host == "127.0.0.1"


def _scrape(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_idle_connections_hold_a_few_threads_and_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """main: every idle connection kept a thread for as long as it stayed open (64 here: 64 threads)."""
    monkeypatch.setattr(metrics._Handler, "timeout", 0.5)
    port = metrics.serve_metrics(0, "127.0.0.1")
    assert _scrape(port).startswith(b"HTTP/1.0 200")
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(64)]
    try:
        assert idle[-1].recv(1) == b""  # over the cap: closed at once (so all 64 were accepted by now)
        assert threading.active_count() <= before + metrics.MAX_CONNECTIONS
        for s in idle:  # the rest are closed once idle for the timeout
            assert s.recv(1) == b""
        wait_until(lambda: threading.active_count() <= before, 5, "the idle connections' threads ended")
    finally:
        for s in idle:
            s.close()
    assert _scrape(port).startswith(b"HTTP/1.0 200")
