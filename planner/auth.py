"""Bearer-token auth: roles admin (all), instance (register, assign, report, own instance), reader (GET)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import select

from planner.db import Database
from planner.models import Instance

Role = Literal["admin", "instance", "reader"]
TOKEN_PREFIX = "rfi_"
CACHE_S = 2.0  # an instance token stays valid at most this long after its instance is deleted


@dataclass(frozen=True)
class Principal:
    """Who is calling; `instance_id` is set for a token that registration returned."""

    role: Role
    instance_id: str | None = None

    def may_change(self, instance_id: str) -> bool:
        """Admins change anything; an instance token only its own instance."""
        return self.role == "admin" or (self.role == "instance" and self.instance_id == instance_id)

    def may_write(self) -> bool:
        """Readers may only GET."""
        return self.role in ("admin", "instance")


INSECURE = Principal(role="admin")


def new_instance_token() -> tuple[str, str]:
    """A fresh token and the hash the database keeps (the token itself is never stored)."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    return token, hash_token(token)


def hash_token(token: str) -> str:
    """sha256 hex of a token."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def _roles(admin: str | None, instance: str | None, reader: str | None) -> list[tuple[str | None, Role]]:
    return [(admin, "admin"), (instance, "instance"), (reader, "reader")]


class Authenticator:
    """Turns a bearer token into a Principal; instance tokens are looked up by hash (briefly cached)."""

    def __init__(self, *, db: Database, admin: str | None, instance: str | None, reader: str | None) -> None:
        self._db = db
        self._static: list[tuple[str, Principal]] = [
            (tok, Principal(role=role)) for tok, role in _roles(admin, instance, reader) if tok
        ]
        self._cache: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()

    def authenticate_cached(self, token: str) -> Principal | None | bool:
        """Without touching the database: the principal, None when unknown, False when a lookup is needed."""
        for known, principal in self._static:
            if hmac.compare_digest(
                known.encode("utf-8", "surrogatepass"), token.encode("utf-8", "surrogatepass")
            ):
                return principal
        if not token.startswith(TOKEN_PREFIX) or len(token) > 256:
            return None
        with self._lock:
            hit = self._cache.get(hash_token(token))
        if hit is not None and hit[0] > time.monotonic():
            return Principal(role="instance", instance_id=hit[1])
        return False

    def authenticate(self, token: str) -> Principal | None:
        """The principal for `token`, or None when it is unknown."""
        for known, principal in self._static:
            if hmac.compare_digest(
                known.encode("utf-8", "surrogatepass"), token.encode("utf-8", "surrogatepass")
            ):
                return principal
        if not token.startswith(TOKEN_PREFIX) or len(token) > 256:
            return None
        digest = hash_token(token)
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            return Principal(role="instance", instance_id=hit[1])
        with self._db.read() as s:
            instance_id = s.scalar(select(Instance.id).where(Instance.token_hash == digest))
        if instance_id is None:
            return None
        with self._lock:
            if len(self._cache) > 100_000:
                self._cache.clear()
            self._cache[digest] = (now + CACHE_S, instance_id)
        return Principal(role="instance", instance_id=instance_id)

    def forget(self, instance_id: str) -> None:
        """Drop cached tokens of a deleted instance (this process; others expire within CACHE_S)."""
        with self._lock:
            for digest in [d for d, (_, iid) in self._cache.items() if iid == instance_id]:
                del self._cache[digest]
