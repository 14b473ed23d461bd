"""The reaper: silent instances turn STALE, expired leases end, long-STALE instances go."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy import delete, select, update

from planner.db import Database
from planner.models import Instance, InstanceRank, Lease, Manifest
from planner.service.base import rowcount
from planner.service.instances import LIVE_STATUSES
from planner.settings import PlannerSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReapResult:
    """What one reaper pass changed."""

    stale: int
    expired: int
    deleted: int = 0
    lapsed: int = 0  # accusations older than accusation_s, lifted


def reap(db: Database, settings: PlannerSettings, now: float) -> ReapResult:
    """Mark silent instances STALE, end expired leases, lift accusations older than accusation_s, and
    delete instances STALE for longer than stale_retention_s with their ranks and manifests (up to
    32 MiB each); safe from several processes.

    An accusation that no probation pull ended (its claims came from distinct credentials, or nobody
    else asked for the identity) lapses: the seed is offered again and loaders verify every byte as
    always, so a seed accused through a shared token is not out of service until it restarts."""
    gone = _delete_retired(db, settings, now)
    with db.write() as s:
        stale = rowcount(
            s.execute(
                update(Instance)
                .where(
                    Instance.status.in_(LIVE_STATUSES),
                    Instance.last_heartbeat < now - settings.heartbeat_ttl_s,
                )
                .values(status="STALE", updated_at=now)
            )
        )
        expired = rowcount(
            s.execute(
                update(Lease)
                .where(Lease.ended_at.is_(None), Lease.expires_at <= now)
                .values(ended_at=now, outcome="expired")
            )
        )
        lapsed = rowcount(
            s.execute(
                update(Instance)
                .where(Instance.accused_since < now - settings.accusation_s)
                .values(accused_since=None)
            )
        )
    if stale or expired or gone:
        log.info(
            "reaper: %d instances STALE, %d leases expired, %d STALE instances deleted", stale, expired, gone
        )
    if lapsed:
        log.warning(
            "reaper: %d accusation(s) older than accusation_s = %.0f s lapsed; those seeds serve again",
            lapsed,
            settings.accusation_s,
        )
    return ReapResult(stale=stale, expired=expired, deleted=gone, lapsed=lapsed)


def _delete_retired(db: Database, settings: PlannerSettings, now: float, batch: int = 500) -> int:
    """Delete up to `batch` instances STALE since before now - stale_retention_s (instance row first,
    then its manifests, ranks and live leases: the one lock order)."""
    with db.write() as s:
        q = (
            select(Instance.id)
            .where(
                Instance.status == "STALE",
                Instance.updated_at < now - settings.stale_retention_s,
                Instance.last_heartbeat < now - settings.stale_retention_s,  # silent all along
            )
            .order_by(Instance.updated_at)
            .limit(batch)
        )
        if not db.sqlite:
            q = q.with_for_update(skip_locked=True)
        ids = list(s.execute(q).scalars().all())
        if not ids:
            return 0
        s.execute(delete(Manifest).where(Manifest.instance_id.in_(ids)))
        s.execute(delete(InstanceRank).where(InstanceRank.instance_id.in_(ids)))
        s.execute(delete(Instance).where(Instance.id.in_(ids)))
        s.execute(
            update(Lease)
            .where(Lease.instance_id.in_(ids), Lease.ended_at.is_(None))
            .values(ended_at=now, outcome="released")
        )
    return len(ids)
