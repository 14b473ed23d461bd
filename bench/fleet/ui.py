"""The planner's fleet page (/ui) on 127.0.0.1 of this machine while the fleet runs.

The planner listens on its emulated host (198.19.0.1, in a namespace the root namespace has no route
to). A forwarder listens on 127.0.0.1:PORT here and opens each upstream connection from a thread that
has entered the planner's network namespace (setns), so the browser reaches the planner without the
root namespace getting an address in the benchmark range or a route into the fleet.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
import threading

from bench.fleet.network import NETNS_DIR

log = logging.getLogger(__name__)
CLONE_NEWNET = 0x40000000


def _enter_netns(name: str) -> None:
    """Move the calling thread into network namespace `name` (setns(2) applies to this thread only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


class Forwarder:
    """127.0.0.1:`port` -> `host`:`target_port` inside namespace `netns`, one thread pair per connection."""

    def __init__(self, netns: str, host: str, target_port: int, port: int) -> None:
        self.netns, self.host, self.target_port, self.port = netns, host, target_port, port
        self._listener = socket.create_server(("127.0.0.1", port), reuse_port=False)
        self._stop = threading.Event()
        self._connector_ready = threading.Event()
        self._requests: list[tuple[socket.socket, threading.Event, list[socket.socket]]] = []
        self._wake = threading.Condition()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/ui"

    def start(self) -> Forwarder:
        threading.Thread(target=self._connector, name="fleet-ui-netns", daemon=True).start()
        self._connector_ready.wait(5)
        threading.Thread(target=self._accept, name="fleet-ui-accept", daemon=True).start()
        return self

    def _connector(self) -> None:
        """Lives in the planner's namespace: opens the upstream sockets (a socket keeps its namespace)."""
        _enter_netns(self.netns)
        self._connector_ready.set()
        while not self._stop.is_set():
            with self._wake:
                while not self._requests and not self._stop.is_set():
                    self._wake.wait(0.5)
                pending, self._requests = self._requests, []
            for _client, done, out in pending:
                with contextlib.suppress(OSError):
                    out.append(socket.create_connection((self.host, self.target_port), timeout=5))
                done.set()

    def _accept(self) -> None:
        self._listener.settimeout(0.5)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            done, out = threading.Event(), list[socket.socket]()
            with self._wake:
                self._requests.append((client, done, out))
                self._wake.notify()
            if not done.wait(6) or not out:
                client.close()
                continue
            upstream = out[0]
            upstream.settimeout(None)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._wake:
            self._wake.notify_all()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
