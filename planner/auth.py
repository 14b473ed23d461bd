"""Bearer-token auth with least privilege.

Static tokens (settings): admin (everything), register (POST /v1/instances only), anchor (register,
and the instance's first disk publication sets its identity's anchor), load (request assignments and
report on the leases it holds), reader (GET; manifests without descriptors). One string configured for
several roles holds them all (e.g. a loader that becomes a seed: load+register). `instance_token` is
the old combined token: register+load. A registration returns an instance token (`rfi_...`) that
changes only its own instance; it may request and report leases, for its own identity only, when the
registering token held the load role (register never implies load).
"""

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

Role = Literal["admin", "register", "anchor", "load", "reader", "instance"]
TOKEN_PREFIX = "rfi_"
# An instance token stays valid at most this long after its instance is deleted, in planner processes
# other than the one that deleted it (that one forgets it at once); its heartbeat, status and manifest
# calls answer 404 at once anyway (they touch its row), so what it can still do meanwhile is request
# assignments for its identity. Longer than a seed's heartbeat interval (ttl/3, at most 10 s): with
# 2 s every heartbeat of a secured fleet missed the cache (a database lookup in a thread, then the
# full FastAPI path instead of planner.hotpath).
CACHE_S = 15.0
NEGATIVE_CACHE_S = 2.0  # an unknown `rfi_` token is refused without a lookup this long
CACHE_MAX = 100_000


@dataclass(frozen=True)
class Principal:
    """Who is calling: the roles a token holds; `instance_id` for a token that registration returned.

    `holder` names the caller for lease ownership: leases are reported on only by their holder.
    """

    roles: frozenset[Role]
    instance_id: str | None = None
    holder: str = "admin"
    # an instance token: the identity it may lease (None: it may not lease)
    lease_identity_key: str | None = None
    # an instance token: the holder of the credential that registered its instance (None: an admin or
    # an instance registered before credentials were recorded: the instance stands for itself)
    credential: str | None = None

    @property
    def witness(self) -> str:
        """Who stands behind this caller's reports when distinct reporters are counted: the credential
        (a static token, or the one that registered the instance), so one credential is one witness
        however many instances it registers; an admin-registered instance is its own."""
        return self.credential or self.holder

    @property
    def role(self) -> str:
        """The roles as one word for messages (e.g. "load+register")."""
        return "+".join(sorted(self.roles))

    def has(self, role: Role) -> bool:
        """Admins hold every role."""
        return "admin" in self.roles or role in self.roles

    def may_change(self, instance_id: str) -> bool:
        """Admins change anything; an instance token only its own instance."""
        return "admin" in self.roles or ("instance" in self.roles and self.instance_id == instance_id)

    def may_write(self) -> bool:
        """Readers may only GET."""
        return bool(self.roles - {"reader"})

    def may_lease(self) -> bool:
        """Request assignments: a load token, admin, or an instance token registered by a load token."""
        return self.has("load") or self.lease_identity_key is not None

    def may_lease_identity(self, identity_key: str) -> bool:
        """An instance token leases its own identity only; load and admin tokens any."""
        return self.has("load") or self.lease_identity_key == identity_key

    def sees_descriptors(self, instance_id: str) -> bool:
        """Descriptors (the data-plane keys) go to admins and to the instance that published them."""
        return self.may_change(instance_id)


INSECURE = Principal(roles=frozenset({"admin"}))


def new_instance_token() -> tuple[str, str]:
    """A fresh token and the hash the database keeps (the token itself is never stored)."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    return token, hash_token(token)


def hash_token(token: str) -> str:
    """sha256 hex of a token."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def _static_principals(tokens: dict[Role, str | None]) -> list[tuple[str, Principal]]:
    """One principal per distinct token string, holding every role configured with that string."""
    by_token: dict[str, set[Role]] = {}
    for role, tok in tokens.items():
        if tok:
            granted: tuple[Role, ...] = (
                ("register", "load")
                if role == "instance"
                else ("register", "anchor")
                if role == "anchor"
                else (role,)
            )
            by_token.setdefault(tok, set()).update(granted)
    return [
        (tok, Principal(roles=frozenset(roles), holder="token:" + hash_token(tok)[:24]))
        for tok, roles in by_token.items()
    ]


def instance_principal(
    instance_id: str, lease_identity_key: str | None = None, registered_by: str | None = None
) -> Principal:
    """The principal of a registered instance's own token (`lease_identity_key`, `registered_by`: the
    registering credential, see Principal)."""
    return Principal(
        roles=frozenset({"instance"}),
        instance_id=instance_id,
        holder="instance:" + instance_id,
        lease_identity_key=lease_identity_key,
        credential=None if registered_by in (None, "admin") else registered_by,
    )


class Authenticator:
    """Turns a bearer token into a Principal; instance tokens are looked up by hash (briefly cached)."""

    def __init__(
        self,
        *,
        db: Database,
        admin: str | None,
        reader: str | None,
        register: str | None = None,
        anchor: str | None = None,
        load: str | None = None,
        instance: str | None = None,
    ) -> None:
        self._db = db
        self._static = _static_principals(
            {
                "admin": admin,
                "register": register,
                "anchor": anchor,
                "load": load,
                "reader": reader,
                "instance": instance,
            }
        )
        # token hash -> (valid until, principal or None for an unknown token)
        self._cache: dict[str, tuple[float, Principal | None]] = {}
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
            return hit[1]
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
            return hit[1]
        with self._db.read() as s:
            row = s.execute(
                select(Instance.id, Instance.identity_key, Instance.may_lease, Instance.registered_by).where(
                    Instance.token_hash == digest
                )
            ).first()
        found: Principal | None = (
            None if row is None else instance_principal(row[0], row[1] if row[2] else None, row[3])
        )
        with self._lock:
            if len(self._cache) > CACHE_MAX:  # a flood of made-up tokens: start over (bounded memory)
                self._cache.clear()
            self._cache[digest] = (now + (CACHE_S if found else NEGATIVE_CACHE_S), found)
        return found

    def forget(self, instance_id: str) -> None:
        """Drop cached tokens of a deleted instance (this process; others expire within CACHE_S)."""
        with self._lock:
            for digest in [
                d for d, (_, p) in self._cache.items() if p is not None and p.instance_id == instance_id
            ]:
                del self._cache[digest]
