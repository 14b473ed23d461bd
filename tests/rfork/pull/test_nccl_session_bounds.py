"""The NCCL session request to a seed is bounded as a whole: a seed that drips or floods its answer
fails the request within about the timeout (not per read), and whatever it answers is an
NcclSessionError or a well-formed session, never another exception. Real sockets, a real server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rfork.pull.nccl import SESSION_ANSWER_MAX_BYTES, NcclSessionError, request_session

Behaviour = Callable[[socket.socket], None]


class RawServer:
    """A TCP server on 127.0.0.1 that hands each connection to `behaviour` on its own thread."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(2.0)
                conn.recv(65536)  # the request
                self.behaviour(conn)
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        self.thread.join(5)


@pytest.fixture
def serve() -> Iterator[Callable[[Behaviour], RawServer]]:
    servers: list[RawServer] = []

    def start(behaviour: Behaviour) -> RawServer:
        servers.append(RawServer(behaviour))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def drip(stop_after_s: float = 30.0) -> Behaviour:
    """An answer that never ends: one byte every 50 ms (a per-read timeout never fires)."""

    def behaviour(conn: socket.socket) -> None:
        data = b'HTTP/1.1 201 Created\r\nContent-Length: 100000\r\n\r\n{"session_id": "' + b"a" * 100000
        end = time.monotonic() + stop_after_s
        for byte in data:
            if time.monotonic() > end:
                return
            conn.sendall(bytes([byte]))
            time.sleep(0.05)

    return behaviour


def test_a_dripping_seed_fails_the_session_request_within_the_timeout(serve) -> None:
    """On main the request stayed open for as long as the seed dripped (30 s here), at timeout_s=1."""
    srv = serve(drip())
    t0 = time.monotonic()
    with pytest.raises(NcclSessionError, match="within 1 s|deadline"):
        request_session(srv.url, 0, timeout_s=1.0)
    assert time.monotonic() - t0 < 10.0  # the seed would drip for 30 s


def test_a_dripping_head_fails_too(serve) -> None:
    def behaviour(conn: socket.socket) -> None:
        for _ in range(600):
            conn.sendall(b"H")
            time.sleep(0.05)

    srv = serve(behaviour)
    t0 = time.monotonic()
    with pytest.raises(NcclSessionError):
        request_session(srv.url, 0, timeout_s=1.0)
    assert time.monotonic() - t0 < 10.0


@pytest.mark.parametrize("chunked", [False, True])
def test_a_flooding_seed_is_cut_off_at_the_size_cap(serve, chunked: bool) -> None:
    """An endless (chunked) or huge declared body: refused at SESSION_ANSWER_MAX_BYTES, not read whole."""
    sent = {"bytes": 0}

    def behaviour(conn: socket.socket) -> None:
        if chunked:
            conn.sendall(b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n")
            piece = b"%x\r\n%s\r\n" % (4096, b"x" * 4096)
        else:
            conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n" % (1 << 40))
            piece = b"x" * 4096
        for _ in range(100_000):  # 400 MB if it were all read
            conn.sendall(piece)
            sent["bytes"] += len(piece)

    srv = serve(behaviour)
    with pytest.raises(NcclSessionError, match="cap"):
        request_session(srv.url, 0, timeout_s=10.0)


def test_a_well_formed_session_answer_is_returned(serve) -> None:
    body = b'{"session_id": "s1", "host": "127.0.0.1", "port": 1234, "backend": "gloo"}'

    def behaviour(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    srv = serve(behaviour)
    assert request_session(srv.url, 0, timeout_s=2.0)["session_id"] == "s1"


def test_a_refusal_keeps_its_status_and_retry_after(serve) -> None:
    body = b'{"error": "busy", "retry_after_s": 1.5}'

    def behaviour(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    srv = serve(behaviour)
    with pytest.raises(NcclSessionError, match="HTTP 429 busy") as err:
        request_session(srv.url, 0, timeout_s=2.0)
    assert err.value.status == 429
    assert err.value.retry_after_s == 1.5


ANSWERS = st.one_of(
    st.binary(max_size=600),
    st.builds(
        lambda status, headers, body: b"HTTP/1.1 %d X\r\n%s\r\n%s" % (status, headers, body),
        st.integers(100, 999),
        st.sampled_from(
            [
                b"",
                b"Content-Length: 5\r\n",
                b"Content-Length: -1\r\n",
                b"Transfer-Encoding: chunked\r\n",
                b"Content-Length: 99999999999999999999\r\n",
                b"Content-Length: \xb2\r\n",
            ]
        ),
        st.one_of(
            st.binary(max_size=300),
            st.sampled_from(
                [
                    b'{"session_id": 1, "host": [], "port": "x", "backend": null}',
                    b"[]",
                    b"null",
                    b'{"error": 5}',
                    b'{"retry_after_s": "soon"}',
                    b"0\r\n\r\n",
                    b"ffffffffffffffff\r\nab",
                ]
            ),
        ),
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(answer=ANSWERS)
def test_whatever_a_seed_answers_is_a_session_or_an_nccl_session_error(serve, answer: bytes) -> None:
    def behaviour(conn: socket.socket) -> None:
        conn.sendall(answer)

    srv = serve(behaviour)
    try:
        got = request_session(srv.url, 0, timeout_s=2.0)
    except NcclSessionError:
        return
    assert isinstance(got["session_id"], str)
    assert isinstance(got["host"], str)
    assert isinstance(got["backend"], str)
    assert 0 < got["port"] < 65536


def test_the_cap_is_small() -> None:
    assert SESSION_ANSWER_MAX_BYTES <= 64 << 10
