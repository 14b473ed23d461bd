"""The interface every transport provider implements; the engine speaks only to this.

A provider opens *domains*: one endpoint with its completion queue and its memory registrations
(one NIC on hardware, one parallel endpoint on tcp). A domain is driven by exactly one progress
thread (posts, polls, waits), so implementations need not be thread-safe for those calls;
`register`, `deregister`, `insert_peer` and `signal` may be called from any thread.
A later CUDA-IPC provider implements the same class.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

EAGAIN = -11  # a post that could not be queued now; poll and retry


class Completion(NamedTuple):
    """One completion-queue entry, provider-neutral; error is 0 or a positive errno."""

    context: int
    flags: int
    length: int
    data: int
    error: int = 0
    message: str = ""


class LocalRegistration(NamedTuple):
    """A registration inside one domain: the key peers use and the local descriptor ops need."""

    key: int
    desc: Any
    handle: Any


class RmaOp(Protocol):
    """What post_batch needs of one op (the engine's chunks have these attributes)."""

    kind: int  # 0 = read, 1 = write
    ptr: int
    length: int
    desc: Any
    peer: int
    raddr: int
    key: int
    ctx: int
    imm: int | None
    delivery_complete: bool


class Domain(abc.ABC):
    """One endpoint of a provider; see the module docstring for threading rules."""

    name: bytes
    mr_virt_addr: bool
    max_inflight: int
    can_wait: bool
    remote_cq_data_flag: int
    recv_flag: int

    @abc.abstractmethod
    def straddr(self, raw: bytes) -> str:
        """A printable name for a raw endpoint name (for error messages)."""

    @abc.abstractmethod
    def insert_peer(self, raw: bytes) -> int:
        """Resolve a peer's raw endpoint name into a handle for posts."""

    @abc.abstractmethod
    def register(self, ptr: int, nbytes: int, remote_read: bool, remote_write: bool) -> LocalRegistration:
        """Register memory for local use and for the granted remote access."""

    @abc.abstractmethod
    def deregister(self, reg: LocalRegistration) -> None:
        """Release one registration."""

    @abc.abstractmethod
    def post_read(self, ptr: int, n: int, desc: Any, peer: int, raddr: int, key: int, ctx: int) -> int:
        """Post a one-sided read; 0 or EAGAIN."""

    @abc.abstractmethod
    def post_write(
        self,
        ptr: int,
        n: int,
        desc: Any,
        peer: int,
        raddr: int,
        key: int,
        ctx: int,
        imm: int | None,
        delivery_complete: bool,
    ) -> int:
        """Post a one-sided write (with an immediate if imm is not None); 0 or EAGAIN."""

    def post_batch(self, ops: Sequence[RmaOp]) -> tuple[int, int, str]:
        """Post reads/writes in order until one cannot be: (posted, rc, message).

        rc is 0 when all were posted, EAGAIN when ops[posted] must be retried later, or another
        negative code when ops[posted] failed (message says why). Providers override this with
        one native call; this default posts one at a time.
        """
        for i, op in enumerate(ops):
            try:
                if op.kind == 0:
                    rc = self.post_read(op.ptr, op.length, op.desc, op.peer, op.raddr, op.key, op.ctx)
                else:
                    rc = self.post_write(
                        op.ptr, op.length, op.desc, op.peer, op.raddr, op.key, op.ctx, op.imm,
                        op.delivery_complete,
                    )
            except Exception as exc:  # noqa: BLE001 - reported to the caller for this op
                return i, -5, str(exc)
            if rc == EAGAIN:
                return i, EAGAIN, ""
        return len(ops), 0, ""

    @abc.abstractmethod
    def post_send(self, ptr: int, n: int, desc: Any, peer: int, ctx: int) -> int:
        """Post a two-sided send; 0 or EAGAIN."""

    @abc.abstractmethod
    def post_recv(self, ptr: int, n: int, desc: Any, ctx: int) -> int:
        """Post a receive buffer for two-sided messages; 0 or EAGAIN."""

    @abc.abstractmethod
    def poll(self) -> list[Completion]:
        """Drive progress and return the completions ready now (possibly none)."""

    @abc.abstractmethod
    def wait(self, timeout_s: float) -> list[Completion]:
        """Block until completions arrive or timeout_s passes; returns them (maybe none)."""

    @abc.abstractmethod
    def signal(self) -> None:
        """Wake a thread blocked in wait()."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the endpoint, queues and fabric objects."""
