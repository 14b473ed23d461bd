"""Where a peer's raw endpoint name points, read without opening a provider.

A loader checks a seed's fabric address against its allowed networks before the name reaches the
provider: a tcp name inserted into the address vector is connected to (and sent bytes) at the first
op, so the check must come first. The row's `names` (backends.providers.registry) says how to read
one: `sockaddr` (tcp, verbs: a struct sockaddr_in or sockaddr_in6), `local` (shm: a process on this
host, reached like a loopback address) or `fabric` (efa: a device GID and queue pair, not an IP
address; it reaches only EFA devices, so it has no IP address to check).
"""

from __future__ import annotations

import ipaddress
import socket
import struct

from backends.errors import TransferError
from backends.providers.registry import lookup

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_LOOPBACK = ipaddress.ip_address("127.0.0.1")


def sockaddr_ip(raw: bytes) -> tuple[IPAddress, int]:
    """(address, port) of a struct sockaddr_in / sockaddr_in6; TransferError for anything else."""
    if len(raw) < 2:
        raise TransferError(f"peer name of {len(raw)} bytes is not a socket address")
    (family,) = struct.unpack_from("=H", raw, 0)
    if family == socket.AF_INET and len(raw) == 16:
        (port,) = struct.unpack_from("!H", raw, 2)
        return ipaddress.IPv4Address(raw[4:8]), port
    if family == socket.AF_INET6 and len(raw) == 28:
        (port,) = struct.unpack_from("!H", raw, 2)
        return ipaddress.IPv6Address(raw[8:24]), port
    raise TransferError(f"peer name of {len(raw)} bytes, family {family}, is not an IPv4 or IPv6 address")


def peer_ip(provider: str, raw: bytes) -> IPAddress | None:
    """The IP address a peer's name makes this provider connect to (127.0.0.1 for a shm process on this
    host), or None where the name is not an IP address (efa). TransferError for a malformed name;
    BackendUnavailable for an unknown provider."""
    kind = lookup(provider).names
    if kind == "sockaddr":
        return sockaddr_ip(raw)[0]
    if kind == "local":
        return _LOOPBACK
    return None
