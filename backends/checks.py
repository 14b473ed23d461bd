"""The checks every one-sided op passes before anything is posted: the local range, the remote range and
access. Shared by the TransferEngine, FastLane, cuda-ipc and staging; kept apart from the engine so
that cuda-ipc needs no libfabric binding.
"""

from __future__ import annotations

from typing import Protocol

from backends.errors import EngineClosed, RemoteAccessError, TransferError

__all__ = ["check_local", "check_range", "check_remote"]


class _Owner(Protocol):
    @property
    def closed(self) -> bool: ...


class _LocalRegion(Protocol):
    @property
    def engine(self) -> object: ...
    @property
    def closed(self) -> bool: ...
    @property
    def nbytes(self) -> int: ...


class _RemoteRegion(Protocol):
    @property
    def access(self) -> str: ...
    @property
    def length(self) -> int: ...
    @property
    def readable(self) -> bool: ...
    @property
    def writable(self) -> bool: ...


def check_range(op: str, side: str, offset: int, length: int, size: int, what: str = "region") -> None:
    """RemoteAccessError naming op and side unless [offset, offset + length) lies inside [0, size)."""
    if offset < 0 or length < 0 or offset + length > size:
        raise RemoteAccessError(
            f"{op}: {side} range [{offset}, {offset + length}) is outside the {size}-byte {what}"
        )


def check_local(owner: _Owner, region: _LocalRegion, offset: int, length: int, op: str) -> None:
    """The owner is open, the region is its own and registered, and the range lies inside it."""
    if owner.closed:
        raise EngineClosed(f"{op}: engine is closed")
    if region.engine is not owner or region.closed:
        raise TransferError(f"{op}: local region is deregistered or belongs to another engine")
    check_range(op, "local", offset, length, region.nbytes)


def check_remote(desc: _RemoteRegion, offset: int, length: int, op: str, *, need: str) -> None:
    """The remote region grants `need` ("read" or "write") and the range lies inside it."""
    if not (desc.readable if need == "read" else desc.writable):
        raise RemoteAccessError(f"{op}: remote region grants {desc.access!r} access, not {need}")
    check_range(op, "remote", offset, length, desc.length)


