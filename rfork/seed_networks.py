"""Which networks a loader may connect to when a seed names an endpoint (`RFORK_SEED_NETWORKS`).

A seed's control_url and the session hosts its control endpoint answers come from whoever holds a
register token; without a limit every loader would connect wherever such a token points (blind SSRF
from every loader). `RFORK_SEED_NETWORKS` is a comma- or space-separated CIDR list (e.g.
`10.0.0.0/8,fd00::/8`); unset or empty allows every address (the default: a trusted fleet). The check
resolves the host once and returns the addresses to connect to, so a name cannot resolve to an allowed
address for the check and another for the connection. A malformed list is fatal (ValueError): a
security setting that silently allowed everything would be worse than none.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping

ENV = "RFORK_SEED_NETWORKS"
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class SeedNetworkRefused(ConnectionRefusedError):
    """A seed endpoint resolves to an address outside RFORK_SEED_NETWORKS; nothing was connected."""


def allowed_networks(env: Mapping[str, str] | None = None) -> list[Network] | None:
    """The configured networks, or None when every address is allowed. ValueError for a bad entry."""
    text = (os.environ if env is None else env).get(ENV, "")
    entries = text.replace(",", " ").split()
    if not entries:
        return None
    try:
        return [ipaddress.ip_network(e, strict=False) for e in entries]
    except ValueError as exc:
        raise ValueError(f"{ENV}: {exc} (a comma-separated list of CIDR networks, e.g. 10.0.0.0/8)") from exc


def resolve_seed_host(host: str, port: int, *, env: Mapping[str, str] | None = None) -> list[tuple[str, int]]:
    """(address, port) pairs to connect to for a seed's `host`, all inside the allowed networks.

    SeedNetworkRefused when the host resolves to none allowed; OSError when it does not resolve.
    """
    networks = allowed_networks(env)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addrs = list(dict.fromkeys((str(info[4][0]), port) for info in infos))
    if networks is None:
        return addrs
    ok = [(a, p) for a, p in addrs if any(ipaddress.ip_address(a.split("%")[0]) in n for n in networks)]
    if not ok:
        shown = ", ".join(a for a, _ in addrs)
        raise SeedNetworkRefused(f"seed endpoint {host} ({shown}) is outside {ENV}; not connecting")
    return ok
