"""Provider parameterisation and spawned peer processes for the transport conformance suite."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import pytest

os.environ.setdefault("FI_TCP_IFACE", "lo")  # pin tcp to loopback (children inherit it)

from tests.backends.peer import serve  # noqa: E402
from tests.backends.processes import CTX

PROVIDERS = [p.strip() for p in os.environ.get("RFORK_TEST_PROVIDERS", "tcp,shm").split(",") if p.strip()]
SRC_BYTES = 1 << 30


@dataclass
class Peer:
    proc: BaseProcess
    conn: Connection
    address: bytes
    descs: dict[str, bytes]
    lock: Any = field(default=None)

    def call(self, *cmd: Any, timeout: float = 60.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd[0]!r} within {timeout}s")
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("exit",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


def start_peer(
    provider: str, regions: list[tuple[str, int, str]], *, domains: int = 2, reorder: bool = True
) -> Peer:
    ctx = CTX
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(child, provider, domains, regions, reorder), daemon=True)
    proc.start()
    child.close()
    if not parent.poll(60):
        proc.kill()
        raise RuntimeError("peer did not start within 60s")
    address, descs = parent.recv()
    return Peer(proc, parent, address, descs)


def skip_unless_pairs_within_process(provider: str) -> None:
    """Skip a test that makes two engines of this process peers where the provider would crash on it
    (shm from libfabric 2.5: rfork refuses such a peer; docs/transport.md)."""
    from backends.providers.libfabric import libfabric_version, pairs_within_process

    if not pairs_within_process(provider):
        major, minor = libfabric_version()
        pytest.skip(f"{provider} on libfabric {major}.{minor}: two endpoints of one process cannot be peers")


@pytest.fixture(scope="module", params=PROVIDERS)
def provider(request: pytest.FixtureRequest) -> str:
    from backends import provider_available

    name = str(request.param)
    if not provider_available(name, "127.0.0.1" if name == "tcp" else None):
        pytest.skip(f"provider {name} is not available on this machine")
    return name


@pytest.fixture(scope="module")
def peer(provider: str) -> Iterator[Peer]:
    """A long-lived peer per provider: 1 GiB read-only source, 1 GiB and 16 MiB writable regions, and
    1 MiB read-only ("ro") and write-only ("wo") ones."""
    p = start_peer(
        provider,
        [
            ("src", SRC_BYTES, "read"),
            ("dst", SRC_BYTES, "rw"),
            ("small", 16 << 20, "rw"),
            ("ro", 1 << 20, "read"),
            ("wo", 1 << 20, "write"),
        ],
    )
    yield p
    p.stop()
