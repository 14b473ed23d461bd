"""The wire protocol's version: what a loader, a seed and the planner must agree on to share a fleet.

The version counts changes that old peers cannot read (a wire body, a descriptor format, a manifest
field a loader must understand), not releases of rfork: seeds and loaders of different releases
share a fleet while they speak the same protocol and their identities (the bytes and their layout)
are equal. Every client request carries `X-Rfork-Protocol: N`; a planner that does not speak N
refuses it with 400 `{"reason": "protocol_version"}` (planner.contract.errors.ProtocolMismatch), so a
peer of another protocol never registers nor gets an assignment, and no loader ever pulls from a
seed it cannot read. A request without the header (a browser, a probe, curl) is not checked.
"""

from __future__ import annotations

# what this side speaks; raise it only with a change old peers cannot read (2: manifests' stripe digests,
# which the digest set covers: a loader that dropped them would find every such seed's set changed)
PROTOCOL_VERSION = 2
SUPPORTED_PROTOCOLS = frozenset({2})  # what this planner accepts
HEADER = "X-Rfork-Protocol"
REASON = "protocol_version"


def protocol_problem(value: str | None) -> str | None:
    """Why a request's protocol header is refused, or None when this planner speaks it."""
    if value is None:
        return None  # a client from before the header: protocol 1
    try:
        version = int(value)
    except ValueError:
        return f"{HEADER} {value[:32]!r} is not a protocol number"
    if version in SUPPORTED_PROTOCOLS:
        return None
    speaks = ", ".join(str(v) for v in sorted(SUPPORTED_PROTOCOLS))
    return (
        f"this planner speaks wire protocol {speaks}, the client speaks {version}: run rfork releases "
        "of one protocol across the fleet (upgrade the planner first, then seeds and loaders)"
    )
