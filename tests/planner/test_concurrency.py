"""Two `rfork planner serve` processes on one database never over-subscribe a seed."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from planner.contract import PlannerClient
from tests.planner.conftest import identity, manifest, ranks
from tests.waiting import wait_until


def free_port() -> int:
    """A port nothing listens on, for a server that binds it a moment later: below the kernel's
    ephemeral range, since a port from bind(0) may meanwhile go to an outgoing connection."""
    try:
        high = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) - 1
    except (OSError, ValueError, IndexError):
        high = 32767
    for port in random.sample(range(10000, min(high, 21999) + 1), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 10000-21999")


def _serve(url: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "RFORK_REAPER_INTERVAL_S": "3600"}
    # the log goes to a file, never an unread pipe: a full pipe blocks the server inside logging
    log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "rfork", "planner", "serve", "--db", url, "--port", str(port), "--insecure"],
        stdout=subprocess.DEVNULL,
        stderr=log,
        env=env,
    )
    setattr(proc, "rfork_log", log)  # noqa: B010
    return proc


def _plain_http(connections: int) -> httpx.Client:
    """A client for http:// only: httpx builds a TLS context (every CA, ~60 ms of CPU) per client unless
    told not to verify, and 64 of them at once were most of this test's time, not the planner's."""
    return httpx.Client(verify=False, timeout=60, limits=httpx.Limits(max_connections=connections))


def _wait(base: str, proc: subprocess.Popen, http: httpx.Client) -> None:
    def healthy() -> bool:
        if proc.poll() is not None:
            log = getattr(proc, "rfork_log")  # noqa: B009
            log.seek(0)
            raise RuntimeError(f"planner exited: {log.read().decode()[-2000:]}")
        try:
            return http.get(base + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, 60, f"the planner at {base} is healthy", every_s=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("n_requests", [64])
def test_two_processes_never_exceed_the_limit(planner_url, n_requests):
    ports = [free_port(), free_port()]
    procs = [_serve(planner_url, p) for p in ports]
    bases = [f"http://127.0.0.1:{p}" for p in ports]
    http = _plain_http(n_requests)
    try:
        for base, proc in zip(bases, procs, strict=True):
            _wait(base, proc, http)
        c = PlannerClient(bases[0])
        seed = c.register_instance(identity=identity(), ranks=ranks(0), max_concurrent_pulls=2).id
        c.put_manifest(seed, 0, manifest(0))
        c.set_status(seed, "READY")
        body = {"identity": identity(), "rank": 0, "providers": ["tcp"], "backends": []}

        def ask(i: int) -> int:
            return http.post(bases[i % 2] + "/v1/assignments", json=body).status_code

        with ThreadPoolExecutor(n_requests) as pool:
            codes = list(pool.map(ask, range(n_requests)))
        assert codes.count(201) == 2, codes
        assert codes.count(429) == n_requests - 2, codes
        eng = create_engine(planner_url)
        with eng.connect() as conn:
            live = conn.execute(text("SELECT count(*) FROM leases WHERE ended_at IS NULL")).scalar()
        eng.dispose()
        assert live == 2
    finally:
        http.close()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
