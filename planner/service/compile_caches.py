"""Compile caches: which READY instances serve a compiled artifact, with a fetch token each
(routes/compile_caches.py)."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import or_, select

from planner.contract import control_token, wire
from planner.contract.errors import NoSource
from planner.models import CompileCache, Instance
from planner.service.base import ServiceState


class CompileCacheOps(ServiceState):
    """Planner's compile-cache sources."""

    def compile_cache_sources(
        self, cache_key: str, now: float, *, may_lease: Callable[[str], bool], labels: wire.Labels
    ) -> wire.CompileCacheSources:
        """READY, unquarantined instances serving `cache_key` (same node, rack, zone first), each with a
        control token for one fetch (planner.contract.control_token, a compile-cache grant: no weight
        session).

        `may_lease(identity_key)`: whether the caller may have that identity's artifacts (an instance
        token: its own identity only). Raises NoSource (404) when none is left.
        """
        q = (
            select(Instance)
            .join(CompileCache, CompileCache.instance_id == Instance.id)
            .where(
                CompileCache.cache_key == cache_key,
                Instance.status == "READY",
                Instance.last_heartbeat >= now - self.settings.heartbeat_ttl_s,
                or_(Instance.quarantined_until.is_(None), Instance.quarantined_until <= now),
                Instance.reverify_since.is_(None),
                Instance.integrity_failed.is_(False),
                Instance.control_url.is_not(None),
                Instance.control_key.is_not(None),
            )
            .order_by(Instance.id)
        )
        with self.db.read() as s:
            rows = [i for i in s.execute(q).scalars().all() if may_lease(i.identity_key)]
        if not rows:
            raise NoSource(f"no READY instance serves compile cache {cache_key[:12]}")
        rows.sort(key=lambda i: (i.node != labels.node, i.rack != labels.rack, i.zone != labels.zone))
        expires_at = now + self.settings.lease_ttl_s
        sources = [
            wire.CompileCacheSource(
                instance_id=i.id,
                control_url=str(i.control_url),
                labels=wire.Labels(node=i.node, rack=i.rack, zone=i.zone),
                control_token=control_token.issue_compile_cache(
                    control_token.unseal(self._control_secret, i.id, str(i.control_key)),
                    instance_id=i.id,
                    expires_at=expires_at,
                ),
            )
            for i in rows[:8]
        ]
        return wire.CompileCacheSources(cache_key=cache_key, sources=sources)
