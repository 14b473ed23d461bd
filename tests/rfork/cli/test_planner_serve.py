"""`rfork planner serve` as an operator starts it: the real address once bound, one line for a taken
port or an unreachable database, and /metrics that count every worker of `--workers N`."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from planner.db import redact_url
from tests.waiting import holds_for, wait_until


@contextmanager
def serving(
    *args: str, timeout_s: float = 60.0, extra_env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`rfork planner serve ARGS` until it prints its address; (the address, the process)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rfork", "planner", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout_s
        seen: list[str] = []
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise AssertionError("planner exited:\n" + "".join(seen))
            seen.append(line)
            found = re.search(r"planner listening on (http://\S+)", line)
            if found:
                yield found.group(1), proc
                return
        raise AssertionError("no address printed:\n" + "".join(seen))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait_ready(url: str) -> None:
    def healthy() -> bool:
        try:
            return httpx.get(url + "/healthz", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, 30, f"{url}/healthz answers 200", every_s=0.1)


def test_port_0_prints_the_bound_port_and_a_taken_port_is_one_line(tmp_path):
    # main: "listening on http://127.0.0.1:0" before the bind; a taken port ended in Errno 98, status 3
    with serving("--insecure", "--port", "0", "--db", f"sqlite:///{tmp_path / 'a.db'}") as (url, _proc):
        port = int(url.rsplit(":", 1)[1])
        assert port != 0
        _wait_ready(url)
        taken = subprocess.run(
            [sys.executable, "-m", "rfork", "planner", "serve", "--insecure", "--port", str(port),
             "--db", f"sqlite:///{tmp_path / 'b.db'}"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert taken.returncode == 1
    errors = [ln for ln in taken.stderr.splitlines() if ln.startswith("rfork: error:")]
    assert len(errors) == 1, taken.stderr
    assert f"port {port}" in errors[0]
    assert "already in use" in errors[0]
    assert "Traceback" not in taken.stderr
    assert "listening" not in taken.stdout


def test_an_unreachable_database_is_one_line_without_the_password():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run(
        [sys.executable, "-m", "rfork", "planner", "serve", "--insecure", "--port", "0",
         "--db", f"postgresql+psycopg://rfork:sekrit@127.0.0.1:{port}/rfork"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 1
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("rfork: error:")]
    assert len(errors) == 1, out.stderr
    assert "Connection refused" in errors[0] or "connection" in errors[0].lower()
    assert "RFORK_DB_URL" in errors[0]
    assert "sekrit" not in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "db", ["postgres ql://rfork:sekrit@h/db", "rfork:sekrit@h/db", "postgresql://rfork:sekrit@h:5432/db?x=%"]
)
def test_a_malformed_database_url_is_one_line_without_the_password(db):
    out = subprocess.run(
        [sys.executable, "-m", "rfork", "planner", "serve", "--insecure", "--port", "0", "--no-migrate",
         "--db", db],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 1
    assert [ln for ln in out.stderr.splitlines() if ln.startswith("rfork: error:")], out.stderr
    assert "sekrit" not in out.stderr + out.stdout
    assert "Traceback" not in out.stderr


@given(
    st.sampled_from(["postgresql+psycopg", "postgres ql", "sqlite", ""]),
    st.text(alphabet="abc:/@%? ", max_size=12),
    st.text(alphabet="abc:/@%?[] ", max_size=12),
)
@example("", "", "://")  # a `://` after the password once read as the scheme's: the URL came back whole
def test_a_database_url_is_never_shown_with_its_password(scheme, user, rest):
    url = f"{scheme}://{user}:Pw9Secret@{rest}" if scheme else f"{user}:Pw9Secret@{rest}"
    assert "Pw9Secret" not in redact_url(url)


def _samples(text: str, name: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(name)]


@pytest.mark.slow
def test_metrics_count_every_worker_and_have_no_duplicate_series(tmp_path):
    # main: each process counted its own requests (6 /healthz calls showed 2), with duplicate `_created`
    with serving("--insecure", "--port", "0", "--workers", "2", "--db", f"sqlite:///{tmp_path / 'w.db'}") as (
        url,
        _proc,
    ):
        _wait_ready(url)
        before = _healthz_count(url)
        for _ in range(6):
            with httpx.Client(trust_env=False) as fresh:  # a new connection each: both workers answer some
                assert fresh.get(url + "/healthz").status_code == 200
        for _ in range(4):  # whichever worker answers the scrape says the same
            text = httpx.get(url + "/metrics", trust_env=False).text
            assert _healthz_count_in(text) == before + 6
            series = [ln.rsplit(" ", 1)[0] for ln in text.splitlines() if ln and not ln.startswith("#")]
            assert len(series) == len(set(series)), "duplicate series"
            assert not [s for s in series if "_created" in s]


def _healthz_count(url: str) -> float:
    return _healthz_count_in(httpx.get(url + "/metrics", trust_env=False).text)


def _healthz_count_in(text: str) -> float:
    return sum(
        float(ln.rsplit(" ", 1)[1])
        for ln in _samples(text, "rfork_planner_requests_total")
        if 'route="/healthz"' in ln
    )


@pytest.mark.slow
def test_sigterm_answers_the_request_in_flight_then_exits_0_with_one_line_all_in_json(tmp_path):
    """SIGTERM while a request is in flight (its body half sent): the planner stops taking new
    connections, answers that request, says so in one line and exits 0 (main: killed by the signal
    uvicorn raised again after its shutdown, status -15, nothing said). With --log-format json every
    line it writes, stdout's included, is a JSON object."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rfork", "--log-format", "json", "planner", "serve", "--port", "0",
         "--insecure", "--db", f"sqlite:///{tmp_path / 'p.db'}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        url = first["url"]
        assert first["message"].startswith("planner listening on ")
        _wait_ready(url)
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"identity": {}, "rank": 0}).encode()
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(
                b"POST /v1/assignments HTTP/1.1\r\nHost: planner\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body[:5]
            )
            time.sleep(0.5)  # the request is in uvicorn's hands, waiting for the rest of its body
            proc.send_signal(signal.SIGTERM)
            # still serving that request: a server that stopped on the signal would exit within the window
            holds_for(lambda: proc.poll() is None, 0.5, "the planner still serving the request in flight")
            conn.sendall(body[5:])
            answer = conn.makefile("rb").read().decode()
        assert answer.startswith("HTTP/1.1 422"), answer  # answered (an empty identity is refused)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[-1]["message"] == "planner stopped by SIGTERM: the requests in flight were answered"
    assert all({"time", "level", "logger", "message"} <= set(r) for r in lines)
    assert all(json.loads(line)["level"] in ("INFO", "WARNING") for line in err.splitlines()), err


def _descendants(pid: int) -> list[int]:
    """The processes under `pid` (its uvicorn workers and their helpers), from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [c for c, p in parents.items() if p == parent]
        found += kids
        todo += kids
    return found


@pytest.mark.slow
@pytest.mark.parametrize("given", ["file", "flag"])
def test_workers_serve_a_database_url_given_in_a_file_or_a_flag_and_never_get_it_in_their_environment(
    tmp_path, given
):
    """main: with RFORK_DB_URL_FILE every worker saw both forms set and exited, so nothing served; with
    --db the parent exported the URL (a password, on PostgreSQL) into every worker's environment."""
    db_url = f"sqlite:///{tmp_path / 'w.db'}"
    extra: dict[str, str] = {}
    args = ["--insecure", "--port", "0", "--workers", "2"]
    if given == "file":
        url_file = tmp_path / "db-url"
        url_file.write_text(db_url + "\n")
        url_file.chmod(0o600)
        extra["RFORK_DB_URL_FILE"] = str(url_file)
    else:
        args += ["--db", db_url]
    with serving(*args, extra_env=extra) as (url, proc):
        _wait_ready(url)
        workers = _descendants(proc.pid)
        assert workers
        for pid in [proc.pid, *workers]:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            assert not [v for v in environ if v.startswith(b"RFORK_DB_URL=")], pid
