"""One exception hierarchy for the transport: every failure a caller can see derives from TransferError."""

from __future__ import annotations


class TransferError(Exception):
    """Base of every transport error; messages name the op and, where there is one, the peer."""


class BackendUnavailable(TransferError):
    """The requested provider (or libfabric itself) is not usable on this machine."""


class RemoteAccessError(TransferError):
    """An op falls outside a remote region or needs access the region did not grant."""


class PeerUnreachable(TransferError):
    """The peer closed, refused or reset the connection (e.g. its process died)."""


class TransferTimeout(PeerUnreachable):
    """The peer did not complete an op within the engine's timeout_s."""


class EngineClosed(TransferError):
    """The engine was closed before the op completed."""


class ChannelError(TransferError):
    """A channel was misused (name taken, closed) or its engine has no immediate values left for it."""
