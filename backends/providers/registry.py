"""The providers the engine opens, by name: one row each, saying which module opens its domains.

A row names its module instead of importing it, so that the table, and the error for a name not in
it, need no native library: the module (and its binding) is imported when a domain of the provider
is first opened or probed. Adding a libfabric provider is one row with its fi_info provider hint;
a provider of another kind is one module offering `ProviderModule` plus its row.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from backends.errors import BackendUnavailable

if TYPE_CHECKING:
    from backends.providers.domain import Domain


@dataclass(frozen=True)
class Provider:
    """One row: the name the engine takes, the module that opens its domains, and what differs."""

    name: str
    module: str
    hint: str = ""  # the provider's own name in its module's library (libfabric: fi_info's prov_name)
    binds_host: bool = False  # a host (or RFORK_TCP_HOST) pins the source address
    delivery_complete: bool = True  # every write waits for delivery (docs/transport.md, "Completion")
    names: str = "sockaddr"  # what a peer's endpoint name is (backends.providers.peer_names)


class ProviderModule(Protocol):
    """What a provider's module offers (backends.providers.libfabric is one)."""

    def open_domains(self, provider: str, count: int, *, host: str | None) -> Sequence[Domain]:
        """Open count domains of the named provider (BackendUnavailable where it cannot)."""

    def provider_available(self, provider: str, host: str | None = None) -> bool:
        """Whether the named provider can open a domain on this machine."""


_LIBFABRIC = "backends.providers.libfabric"
PROVIDERS: Mapping[str, Provider] = {
    p.name: p
    for p in (
        Provider("tcp", _LIBFABRIC, hint="tcp;ofi_rxm", binds_host=True),
        Provider("shm", _LIBFABRIC, hint="shm", delivery_complete=False, names="local"),
        Provider("efa", _LIBFABRIC, hint="efa", names="fabric"),
        Provider("verbs", _LIBFABRIC, hint="verbs;ofi_rxm"),
    )
}
AUTO = "auto"
AUTO_ORDER = ("efa", "verbs", "tcp")  # what AUTO takes: the first available here, else tcp


def lookup(provider: str) -> Provider:
    """The row of a provider name; BackendUnavailable naming the known ones for any other name."""
    row = PROVIDERS.get(provider)
    if row is None:
        known = f"{sorted(PROVIDERS)} or {AUTO!r}"
        raise BackendUnavailable(f"unknown provider {provider!r}; choose from {known}")
    return row


def choose(provider: str, host: str | None) -> Provider:
    """The row for a name the engine was given, resolving AUTO on this machine."""
    if provider == AUTO:
        provider = next((p for p in AUTO_ORDER if provider_available(p, host)), "tcp")
    return lookup(provider)


def provider_module(row: Provider) -> ProviderModule:
    """The module that opens the row's domains, imported on first use."""
    return cast(ProviderModule, importlib.import_module(row.module))


def open_domains(row: Provider, count: int, *, host: str | None) -> list[Domain]:
    """Open count domains of the row's provider (parallel endpoints: one per NIC on hardware)."""
    return list(provider_module(row).open_domains(row.name, count, host=host))


def provider_available(provider: str, host: str | None = None) -> bool:
    """True when the named provider can open a domain here (for AUTO and test skips); False for a
    name not in the table, AUTO included (a choice among providers, not one)."""
    row = PROVIDERS.get(provider)
    return row is not None and provider_module(row).provider_available(provider, host)
