"""Which networks a loader may connect to when a seed names an endpoint (`RFORK_SEED_NETWORKS`).

A seed's control_url and the session hosts its control endpoint answers come from whoever holds a
register token; without a limit every loader would connect wherever such a token points (blind SSRF
from every loader). `RFORK_SEED_NETWORKS` is a comma- or space-separated CIDR list (e.g.
`10.0.0.0/8,fd00::/8`); unset or empty allows every address (the default: a trusted fleet). The check
resolves the host once and returns the addresses to connect to, so a name cannot resolve to an allowed
address for the check and another for the connection. A malformed list is fatal (ValueError): a
security setting that silently allowed everything would be worse than none.

The same list holds the fabric addresses inside a seed's memory descriptors (`check_engine_address`):
a tcp or verbs name is a socket address the provider connects to, a shm name a process on this host
(allowed when 127.0.0.1 is), an efa name no IP address at all (not checked).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping

from backends import BackendUnavailable, EngineAddress, TransferError, peer_ip
from planner.contract import NetworkRefused, inside, parse_networks, resolve_within

ENV = "RFORK_SEED_NETWORKS"
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class SeedNetworkRefused(NetworkRefused):
    """A seed endpoint resolves to an address outside RFORK_SEED_NETWORKS; nothing was connected."""


def allowed_networks(env: Mapping[str, str] | None = None) -> list[Network] | None:
    """The configured networks, or None when every address is allowed. ValueError for a bad entry."""
    try:
        return parse_networks((os.environ if env is None else env).get(ENV, ""))
    except ValueError as exc:
        raise ValueError(f"{ENV}: {exc} (a comma-separated list of CIDR networks, e.g. 10.0.0.0/8)") from exc


def resolve_seed_host(host: str, port: int, *, env: Mapping[str, str] | None = None) -> list[tuple[str, int]]:
    """(address, port) pairs to connect to for a seed's `host`, all inside the allowed networks.

    SeedNetworkRefused when the host resolves to none allowed; OSError when it does not resolve.
    """
    try:
        return resolve_within(host, port, allowed_networks(env), what=ENV)
    except NetworkRefused as exc:
        raise SeedNetworkRefused(f"seed endpoint {exc}") from exc


def check_engine_address(address: bytes, *, env: Mapping[str, str] | None = None) -> None:
    """Refuse (SeedNetworkRefused) an engine address with a domain name outside the allowed networks,
    or one that cannot be read (a malformed name, an unknown provider); call it before any op on it."""
    networks = allowed_networks(env)
    if networks is None:
        return
    try:
        ea = EngineAddress.from_bytes(address)
        ips = [peer_ip(ea.provider, name) for name in ea.domains]
    except (TransferError, BackendUnavailable) as exc:
        why = f"fabric address cannot be checked against {ENV} ({exc}); not connecting"
        raise SeedNetworkRefused(why) from exc
    for ip in ips:
        if ip is not None and not inside(ip, networks):
            raise SeedNetworkRefused(f"{ea.provider} fabric address {ip} is outside {ENV}; not connecting")

