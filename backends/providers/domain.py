"""The interface every transport provider implements; the engine speaks only to this.

A provider opens *domains*: one endpoint with its completion queue and its memory registrations
(one NIC on hardware, one parallel endpoint on tcp). Once `start_core` ran, the domain's own native
thread alone posts and polls its endpoint: `submit`, `cancel`, `register`, `deregister` and
`insert_peer` may be called from any thread, `drain` from one thread per domain.
A later CUDA-IPC provider implements the same class.
"""

from __future__ import annotations

import abc
from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

POST_FAILED = 1 << 63  # Completion.flags bit: the op's post itself failed (message says why)
RECV_BASE = 1 << 48  # op contexts at or above are receive buffers (not counted as sends)


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


class WriteBatch(NamedTuple):
    """Writes that go to the provider as several ops and come back as one completion: pieces holds
    (local address, remote address, length) flat, in order; the provider groups them into writes of
    up to its max_segs pieces and max_bytes (only pieces whose remote ends follow each other where it
    does not scatter; none of several pieces and at most ungathered_upto bytes), and a write of at
    most dc_upto bytes is delivery-complete."""

    pieces: array[int]  # 'Q'
    max_bytes: int
    ungathered_upto: int = 0
    dc_upto: int = 0


class RmaOp(Protocol):
    """What submit reads of one op (the engine's chunks have these attributes)."""

    @property
    def kind(self) -> int: ...  # 0 = read, 1 = write, 2 = send, 3 = receive
    @property
    def ptr(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def desc(self) -> Any: ...
    @property
    def peer(self) -> int: ...
    @property
    def raddr(self) -> int: ...
    @property
    def key(self) -> int: ...
    @property
    def ctx(self) -> int: ...
    @property
    def imm(self) -> int | None: ...
    @property
    def delivery_complete(self) -> bool: ...
    @property
    def group(self) -> int: ...  # the user-visible op it belongs to (0: none), for cancelling
    @property
    def hash_job(self) -> int: ...  # a read's native digest job (backends.digest_job), 0: none
    @property
    def batch(self) -> WriteBatch | None: ...  # write pieces posted by the core, completed together


class Domain(abc.ABC):
    """One endpoint of a provider; see the module docstring for threading rules."""

    name: bytes
    mr_virt_addr: bool
    max_inflight: int
    # pieces one write may gather (a local iov each): 1 where the provider cannot; and whether their
    # remote ends may lie apart (several remote iovs) or must follow each other (one remote iov)
    max_segs: int = 1
    scatters: bool = False
    can_wait: bool
    # False where closing the endpoint while ops are still posted to a stalled peer is known to crash
    # the provider (tcp's rxm in libfabric 1.17): the engine then leaves it, and their memory, open.
    closes_with_ops_posted: bool = True
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

    # ----- the progress core: posts and polls on its own native thread --------------------------
    @abc.abstractmethod
    def start_core(self) -> None:
        """Start the domain's progress thread; from now on only it touches the endpoint."""

    @abc.abstractmethod
    def submit(self, ops: Sequence[RmaOp]) -> None:
        """Queue ops (kind 0 read, 1 write, 2 send) for the core to post (any thread); each comes
        back as one Completion from drain. EngineClosed once the core stopped."""

    @abc.abstractmethod
    def drain(self, timeout_s: float) -> list[Completion] | None:
        """Completions ready now, waiting up to timeout_s for the first (without the GIL); None once
        the core stopped and everything was drained. One drainer thread per domain."""

    @abc.abstractmethod
    def cancel(self, *, peer: int = 0, group: int = 0) -> int:
        """Take queued, not yet posted ops out of the core's queue: those to peer, or (group != 0)
        those of that group; they come back from drain with error ECANCELED. Returns how many."""

    @abc.abstractmethod
    def stop_core(self) -> None:
        """Stop the progress thread and wait for it (idempotent); queued ops are not posted."""

    @abc.abstractmethod
    def post_recv(self, ptr: int, n: int, desc: Any, ctx: int) -> int:
        """Queue a receive buffer for two-sided messages in the core (ctx >= RECV_BASE); 0."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the endpoint, queues and fabric objects."""
