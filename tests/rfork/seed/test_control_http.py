"""rfork.seed.control_http under hostile clients: real processes over real sockets.

The seed's control server runs in its own process (as inside an inference process); an attacker
process holds hundreds of connections that drip their request heads one byte at a time; the test
process is the honest loader, whose requests must all be answered within the request deadline.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.contract import issue_control_token, new_control_key

CTX = mp.get_context("spawn")
DEADLINE_S = 2.0
INSTANCE = "0" * 32


def _serve(conn: Connection, key: str, deadline_s: float) -> None:
    """Child: a control server until told to stop; reports its thread count on request."""
    import torch

    from rfork.seed.control import ControlServer

    with ControlServer(
        tensors_for_rank=lambda r: [[torch.zeros(4)]][r],
        control_key=key,
        instance_ids=lambda: [INSTANCE],
        request_timeout_s=deadline_s,
        timeout_s=2.0,
    ) as server:
        conn.send(server.url)
        peak_threads = threading.active_count()
        while not conn.poll(0.05):
            peak_threads = max(peak_threads, threading.active_count())
        conn.recv()
        conn.send({"peak_threads": peak_threads, **server.health()})


def _drip(url: str, count: int, seconds: float, out: Connection) -> None:
    """Child: keep `count` connections open, dripping one byte of a request head to each every 0.2 s.

    A connection the server closes is replaced. Reports how many were opened and the longest any
    lived (closed by the server, or still open at the end).
    """
    host, port = url.removeprefix("http://").split(":")
    head = b"POST /v1/nccl/sessions HTTP/1.1\r\nHost: seed\r\nAuthorization: Bearer " + b"x" * 4000

    def connect() -> tuple[socket.socket, float]:
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((host, int(port)))
        return s, time.monotonic()

    socks = [connect() for _ in range(count)]
    opened, longest, sent = count, 0.0, 0
    piled = False
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        alive = []
        for s, t0 in socks:
            try:
                s.send(head[sent : sent + 1])
                alive.append((s, t0))
            except BlockingIOError:
                alive.append((s, t0))
            except OSError:  # closed by the server: open another in its place
                longest = max(longest, time.monotonic() - t0)
                s.close()
                alive.append(connect())
                opened += 1
        socks = alive
        sent = (sent + 1) % len(head)
        if not piled:  # every connection is open and has dripped a byte: the parent's requests start now
            out.send("piled up")
            piled = True
        time.sleep(0.2)
    now = time.monotonic()
    for s, t0 in socks:
        longest = max(longest, now - t0)
        s.close()
    out.send({"opened": opened, "longest_s": longest})


@contextlib.contextmanager
def _control_process() -> Iterator[tuple[str, str, Connection]]:
    """A control server in a process of its own: (url, control key, the pipe that stops it)."""
    key = new_control_key()
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_serve, args=(child, key, DEADLINE_S), daemon=True)
    proc.start()
    child.close()
    try:
        assert parent.poll(60), "control server did not start"
        url = parent.recv()
        yield url, key, parent
    finally:
        proc.kill()
        proc.join(5)


@pytest.fixture
def seed_control() -> Iterator[tuple[str, str, Connection]]:
    """A server of the test's own: the dripping test reads its whole life's thread and eviction counts."""
    with _control_process() as control:
        yield control


@pytest.fixture(scope="module")
def shared_control() -> Iterator[tuple[str, str, Connection]]:
    """One server for the tests that each use their own connections and leases (a process start is
    seconds: it imports torch)."""
    with _control_process() as control:
        yield control


def _request(url: str, method: str = "GET", body: dict[str, Any] | None = None,
             token: str | None = None) -> tuple[int, dict[str, Any], float]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE_S * 3) as resp:
            return resp.status, json.loads(resp.read()), time.monotonic() - t0
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), time.monotonic() - t0


def _token(key: str, lease: str, rank: int = 0) -> str:
    return issue_control_token(
        key, lease_id=lease, instance_id=INSTANCE, rank=rank, expires_at=time.time() + 60
    )


@pytest.mark.timeout(90)
def test_dripping_connections_never_stop_an_honest_request(seed_control: tuple[str, str, Connection]) -> None:
    url, key, control = seed_control
    attack_s = 6.0
    parent, child = CTX.Pipe()
    # more dripping connections than the server keeps open (256): it must evict them, not the honest one
    attacker = CTX.Process(target=_drip, args=(url, 400, attack_s, child), daemon=True)
    attacker.start()
    child.close()
    try:
        assert parent.poll(30), "the attacker never piled up its connections"
        assert parent.recv() == "piled up"
        latencies: list[float] = []
        lease = 0
        end = time.monotonic() + attack_s - 1.5
        while time.monotonic() < end:
            status, body, took = _request(url + "/v1/health")
            assert status == 200, body
            latencies.append(took)
            status, body, took = _request(url + "/v1/nccl/sessions", "POST", {"rank": 0}, token="v1.x")
            assert status == 403, body
            latencies.append(took)
            lease += 1
            status, body, took = _request(
                url + "/v1/nccl/sessions", "POST", {"rank": 0}, token=_token(key, f"lease{lease}")
            )
            # 201, or 429 while the previous session waits for a loader that never comes
            assert status in (201, 429), body
            latencies.append(took)
            time.sleep(0.1)
        assert latencies
        assert max(latencies) < DEADLINE_S, latencies
        assert parent.poll(30), "attacker did not finish"
        attack = parent.recv()
    finally:
        attacker.join(10)
        if attacker.is_alive():
            attacker.kill()
    control.send("stop")
    assert control.poll(10)
    health = control.recv()
    assert attack["opened"] > 400  # the server closed dripping connections and the attacker reopened
    assert attack["longest_s"] < DEADLINE_S + 1.0, attack  # none outlived the deadline by much
    assert health["peak_threads"] < 20, health  # connections never cost threads
    assert health["evicted_connections"] > 0, health


@pytest.mark.timeout(60)
def test_a_burst_of_connects_is_held_by_the_backlog(shared_control: tuple[str, str, Connection]) -> None:
    url, _key, _control = shared_control
    host, port = url.removeprefix("http://").split(":")
    socks = []
    try:
        for _ in range(300):  # 300 connects at once, each sending its request as it opens
            s = socket.create_connection((host, int(port)), timeout=10)
            socks.append(s)
            s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: seed\r\n\r\n")
        answers = [s.recv(200) for s in socks]
    finally:
        for s in socks:
            s.close()
    bad = [a[:20] for a in answers if not a.startswith(b"HTTP/1.1 200 ")]
    assert not bad, bad


@pytest.mark.timeout(60)
def test_auth_is_checked_before_the_body_is_read(shared_control: tuple[str, str, Connection]) -> None:
    url, key, _control = shared_control
    host, port = url.removeprefix("http://").split(":")
    for auth, want in [(b"", b" 401 "), (b"Authorization: Bearer v1.a.b.0.1.c\r\n", b" 403 ")]:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            # announces a body it never sends: the answer must come at once, not after the deadline
            sock.sendall(b"POST /v1/nccl/sessions HTTP/1.1\r\nHost: seed\r\nContent-Length: 60000\r\n" + auth
                         + b"\r\n")
            t0 = time.monotonic()
            data = sock.recv(1000)
            assert time.monotonic() - t0 < DEADLINE_S / 2, data
            assert want in data, data
    # a valid token and a body that never completes: 408 at the deadline
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/nccl/sessions HTTP/1.1\r\nHost: seed\r\nContent-Length: 100\r\n"
                     b"Authorization: Bearer " + _token(key, "slow").encode() + b"\r\n\r\n{")
        t0 = time.monotonic()
        data = sock.recv(1000)
        assert DEADLINE_S / 2 < time.monotonic() - t0 < DEADLINE_S + 2
        assert b" 408 " in data, data
    # the lease of a token whose body never came is not spent; a token for another rank is refused
    status, body, _ = _request(url + "/v1/nccl/sessions", "POST", {"rank": 1}, token=_token(key, "slow"))
    assert status == 403
    assert "rank" in body["error"]
    status, body, _ = _request(url + "/v1/nccl/sessions", "POST", {"rank": 0}, token=_token(key, "slow"))
    assert status == 201, body
    status, body, _ = _request(url + "/v1/nccl/sessions", "POST", {"rank": 0}, token=_token(key, "slow"))
    assert status == 403
    assert "already used" in body["error"]


@pytest.mark.timeout(60)
def test_malformed_heads_get_4xx(shared_control: tuple[str, str, Connection]) -> None:
    url, _key, _control = shared_control
    host, port = url.removeprefix("http://").split(":")
    for raw in [b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\n" + b"X: " + b"y" * 20000 + b"\r\n\r\n",
                b"POST /v1/nccl/sessions HTTP/1.1\r\nHost: s\r\nContent-Length: -5\r\n\r\n",
                b"DELETE /v1/health HTTP/1.1\r\nHost: s\r\n\r\n"]:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(raw)
            data = sock.recv(1000)
        assert data.startswith(b"HTTP/1.1 4"), (raw[:30], data)


@pytest.fixture(scope="module")
def local_control() -> Iterator[tuple[str, int, str]]:
    """An in-process control server with a key (the fuzz test's target: real sockets, one process)."""
    import torch

    from rfork.seed.control import ControlServer

    key = new_control_key()
    with ControlServer(
        tensors_for_rank=lambda r: [[torch.zeros(4)]][r],
        control_key=key,
        instance_ids=lambda: [INSTANCE],
        request_timeout_s=1.0,
        timeout_s=0.5,
        max_concurrent=64,
    ) as server:
        host, port = server.url.removeprefix("http://").split(":")
        yield host, int(port), key


_METHODS = st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"PATCH", b"G\x00T", b""])
_TARGETS = st.sampled_from(
    [b"/v1/health", b"/v1/nccl/sessions", b"/v1/nccl/sessions/abc", b"/", b"*", b"/%00", b"/v1/health?x"]
)
_HEADER = st.tuples(
    st.sampled_from([b"Host", b"Content-Length", b"Authorization", b"Transfer-Encoding", b"X", b"Bad Name"]),
    st.binary(max_size=40),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=_METHODS, target=_TARGETS, headers=st.lists(_HEADER, max_size=5), body=st.binary(max_size=200),
       version=st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b""]))
def test_any_request_gets_an_answer_below_500_within_the_deadline(
    local_control: tuple[str, int, str], method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
    body: bytes, version: bytes,
) -> None:
    host, port, _key = local_control
    head = method + b" " + target + b" " + version + b"\r\n"
    head += b"".join(name + b": " + value.replace(b"\r", b"").replace(b"\n", b"") + b"\r\n"
                     for name, value in headers)
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(head + b"\r\n" + body)
        t0 = time.monotonic()
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
        took = time.monotonic() - t0
    assert took < 3.0  # the 1 s deadline, plus a loaded box
    if answer:  # a request cut short by the peer may get no answer, never a hang or a 5xx
        status = int(answer.split(b" ", 2)[1])
        assert 200 <= status < 500, answer[:200]
