"""What a load's settings must satisfy before anything starts: a planner URL that is a URL, transport
providers that exist and are present on this machine.

A wrong setting is a ConfigurationError naming it, raised at once: falling back to disk would hide a
typo across a whole fleet (every instance cold-starts, and nobody notices). Outages, by contrast,
are not checked here; they fall back as designed (rfork.pull.planner_session).
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from backends import AUTO, PROVIDERS, provider_available
from rfork.errors import ConfigurationError

NCCL = "nccl"  # the two-sided fallback: a provider name a loader may list, not one the engine opens


def check_planner_url(url: str | None) -> str | None:
    """`url` without a trailing slash (None stays None); ConfigurationError when it is not an http(s)
    URL with a host and a valid port (e.g. `127.0.0.1:8470`, written without its scheme)."""
    if url is None:
        return None
    text = url.strip()
    parts = urlsplit(text)

    def bad(why: str) -> ConfigurationError:
        fix = "write it as http://HOST:PORT (e.g. http://127.0.0.1:8470)"
        return ConfigurationError(f"planner URL {url!r} {why}; {fix}", setting="planner_url")

    if parts.scheme not in ("http", "https"):
        raise bad("has no http:// or https:// scheme")
    try:
        port = parts.port
    except ValueError:
        raise bad("has an invalid port") from None
    if not parts.hostname or port == 0:
        raise bad("names no host and port")
    if parts.query or parts.fragment:
        raise bad("carries a query or fragment")
    return text.rstrip("/")


def check_provider_names(providers: Sequence[str]) -> list[str]:
    """`providers` (one-sided names, `auto`, `nccl`), each known; ConfigurationError for a typo."""
    known = [*PROVIDERS, AUTO, NCCL]
    if not providers:
        raise ConfigurationError(
            f"no transport provider given; choose from {', '.join(known)}", setting="providers"
        )
    for name in providers:
        if name not in known:
            raise ConfigurationError(
                f"unknown transport provider {name!r}; choose from {', '.join(known)}", setting="providers"
            )
    return list(providers)


def check_providers_present(providers: Sequence[str]) -> None:
    """ConfigurationError when a named one-sided provider cannot open on this machine (`--provider
    verbs` without a verbs device): the pull would otherwise quietly take NCCL or the disk instead."""
    missing = [p for p in providers if p not in (AUTO, NCCL) and not _present(p)]
    if missing:
        present = [p for p in ("tcp", "shm", "efa", "verbs") if p not in missing and _present(p)]
        raise ConfigurationError(
            f"transport provider {', '.join(missing)} is not available on this machine "
            f"(available here: {', '.join(present) or 'none'}); pick one of those, or auto",
            setting="providers",
        )


def _present(provider: str) -> bool:
    """Whether the provider opens here (probing loads the transport's native binding the first time)."""
    try:
        return bool(provider_available(provider))
    except Exception:  # noqa: BLE001 - a probe that fails means "not here"
        return False
