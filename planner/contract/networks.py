"""CIDR allow-lists for connections a peer's word directs (a seed's control URL): parse a list, and
resolve a host once to the addresses inside it, so a name cannot resolve to an allowed address for
the check and another for the connection. Pure stdlib: used by the planner's health probe and by
loaders (rfork.seed_networks)."""

from __future__ import annotations

import ipaddress
import socket

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class NetworkRefused(ConnectionRefusedError):
    """A host resolves to no address inside the allowed networks; nothing was connected."""


def parse_networks(text: str) -> list[Network] | None:
    """A comma- or space-separated CIDR list; None when empty (every address). ValueError naming the
    bad entry."""
    entries = text.replace(",", " ").split()
    if not entries:
        return None
    return [ipaddress.ip_network(e, strict=False) for e in entries]


def inside(ip: IPAddress, networks: list[Network]) -> bool:
    """True when `ip` (an IPv4-mapped IPv6 address as its IPv4 address) is in one of `networks`."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in n for n in networks)


def resolve_within(
    host: str, port: int, networks: list[Network] | None, *, what: str
) -> list[tuple[str, int]]:
    """(address, port) pairs for `host`, only those inside `networks` (all when None). NetworkRefused
    (naming `what`, the setting) when none is; OSError when the host does not resolve."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addrs = list(dict.fromkeys((str(info[4][0]), port) for info in infos))
    if networks is None:
        return addrs
    ok = [(a, p) for a, p in addrs if inside(ipaddress.ip_address(a.split("%")[0]), networks)]
    if not ok:
        shown = ", ".join(a for a, _ in addrs)
        raise NetworkRefused(f"{host} ({shown}) is outside {what}; not connecting")
    return ok
