"""Per-assignment secrets for a seed's control endpoint (the NCCL fallback), issued with the lease.

The seed picks a random key and registers it (never shown by the API; the database holds it sealed
with the planner's secret, `seal`, so a dump of the database forges nothing). With each lease the planner
issues `v1.<lease>.<instance>.<rank>.<expires>.<mac>`, mac = HMAC-SHA256(key, everything before it).
The seed checks it offline: its own instance, the rank asked for, not expired, the MAC. Only the
loader holding the lease gets the token, so only it can open a session, and only until the lease ends.
Pure stdlib: imported by the planner and by rfork.seed.control.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Collection
from dataclasses import dataclass

VERSION = "v1"
# lease-id prefix of compile-cache grants (planner.service.compile_caches): they fetch one compile
# cache, once, and never open a weight session; weight leases are plain uuid hex. The lease id is
# `cc-<cache key, 64 hex>-<16 random hex>`, so the MAC binds the grant to its key.
COMPILE_CACHE_LEASE = "cc-"


class ControlTokenError(ValueError):
    """A control token is malformed, expired, for another instance or rank, or forged."""


@dataclass(frozen=True)
class ControlGrant:
    """What a valid token allows: one lease's pull of one rank from one instance until `expires_at`."""

    lease_id: str
    instance_id: str
    rank: int
    expires_at: int

    @property
    def compile_cache(self) -> bool:
        """A compile-cache grant (rank 0 by convention: the cache key names the rank)."""
        return self.lease_id.startswith(COMPILE_CACHE_LEASE)

    @property
    def cache_key(self) -> str | None:
        """The one compile-cache key a compile-cache grant fetches (None for a weight lease)."""
        if not self.compile_cache:
            return None
        key = self.lease_id[len(COMPILE_CACHE_LEASE) :].partition("-")[0]
        return key if len(key) == 64 else None


def new_control_key() -> str:
    """A fresh 256-bit key, hex."""
    return secrets.token_hex(32)


def issue_control_token(key: str, *, lease_id: str, instance_id: str, rank: int, expires_at: float) -> str:
    """The token for one lease."""
    head = f"{VERSION}.{lease_id}.{instance_id}.{int(rank)}.{int(expires_at)}"
    return f"{head}.{_mac(key, head)}"


def issue_compile_cache(key: str, *, instance_id: str, cache_key: str, expires_at: float) -> str:
    """A token to fetch compile cache `cache_key` once from one instance until `expires_at` (no weight
    session)."""
    lease_id = f"{COMPILE_CACHE_LEASE}{cache_key}-{secrets.token_hex(8)}"
    return issue_control_token(key, lease_id=lease_id, instance_id=instance_id, rank=0, expires_at=expires_at)


def claimed_rank(token: str) -> int | None:
    """The rank a token names, unchecked (the seed needs it before verifying); None when malformed."""
    parts = token.split(".")
    return _uint(parts[3]) if len(parts) == 6 else None


def verify_control_token(
    token: str, key: str, *, instance_ids: Collection[str], rank: int, now: float
) -> ControlGrant:
    """The grant of a valid token; ControlTokenError naming what is wrong otherwise."""
    parts = token.split(".")
    if len(parts) != 6 or parts[0] != VERSION:
        raise ControlTokenError("control token: malformed")
    _, lease_id, instance_id, rank_s, expires_s, mac = parts
    # bytes: compare_digest raises TypeError for a str with non-ASCII characters
    if not hmac.compare_digest(mac.encode("utf-8", "surrogatepass"), _mac(key, ".".join(parts[:5])).encode()):
        raise ControlTokenError("control token: signature does not match this seed's key")
    if instance_id not in instance_ids:
        raise ControlTokenError(f"control token: issued for instance {instance_id}, not this seed")
    if _uint(rank_s) != rank:
        raise ControlTokenError(f"control token: issued for rank {rank_s!r}, not rank {rank}")
    expires = _uint(expires_s)
    if expires is None or expires < now:
        raise ControlTokenError(f"control token: lease {lease_id!r} has expired or names no expiry")
    return ControlGrant(lease_id=lease_id, instance_id=instance_id, rank=rank, expires_at=expires)


def _uint(text: str) -> int | None:
    """ASCII digits only (str.isdigit also accepts '²' and other digits int() refuses); at most 19."""
    if not text or len(text) > 19 or not (text.isascii() and text.isdigit()):
        return None
    return int(text)


def _mac(key: str, text: str) -> str:
    return hmac.new(key.encode(), text.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


_HEX = "0123456789abcdef"


def seal(secret: bytes, instance_id: str, key: str) -> str:
    """`key` (hex) encrypted for storage: each digit shifted mod 16 by a pad that HMAC-SHA256(secret,
    instance id, block) derives; same length and alphabet, so the column and its limits stay. One key
    per instance id, so a pad is never used twice."""
    pad = _pad(secret, instance_id, len(key))
    return "".join(_HEX[(_HEX.index(c) + p) % 16] for c, p in zip(key, pad, strict=True))


def unseal(secret: bytes, instance_id: str, sealed: str) -> str:
    """The key `seal` stored (garbage, never an error, with another secret: its tokens just fail)."""
    pad = _pad(secret, instance_id, len(sealed))
    return "".join(_HEX[(_HEX.index(c) - p) % 16] for c, p in zip(sealed, pad, strict=True))


def _pad(secret: bytes, instance_id: str, n: int) -> list[int]:
    out: list[int] = []
    block = 0
    while len(out) < n:
        digest = hmac.new(secret, f"control-key/{instance_id}/{block}".encode(), hashlib.sha256).digest()
        out += [b & 0x0F for b in digest]
        block += 1
    return out[:n]
