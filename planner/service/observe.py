"""What readers and /metrics see: models, finished transfers, status counts, live leases
(routes/observe.py)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select

from planner.contract.views import ModelsPage, ModelView, TransfersPage, TransferView
from planner.models import Instance, Lease
from planner.service.base import ServiceState


class ObserveOps(ServiceState):
    """Planner's read-only views."""

    def models(self, now: float) -> ModelsPage:
        """Every identity with its instance count and READY (fresh, not quarantined) count."""
        with self.db.read() as s:
            rows = s.execute(
                select(
                    Instance.identity_key,
                    Instance.status,
                    Instance.last_heartbeat,
                    Instance.quarantined_until,
                )
            ).all()
            agg: dict[str, list[int]] = {}
            for r in rows:
                a = agg.setdefault(r.identity_key, [0, 0])
                a[0] += 1
                fresh = r.last_heartbeat >= now - self.settings.heartbeat_ttl_s
                free = r.quarantined_until is None or r.quarantined_until <= now
                a[1] += int(r.status == "READY" and fresh and free)
            idents: dict[str, dict[str, Any]] = {}
            for k in agg:
                idents[k] = (
                    s.scalar(select(Instance.identity).where(Instance.identity_key == k).limit(1)) or {}
                )
        items = [
            ModelView(identity_key=k, identity=idents[k], instances=a[0], ready=a[1])
            for k, a in sorted(agg.items(), key=lambda kv: (str(idents[kv[0]].get("model")), kv[0]))
        ]
        return ModelsPage(items=items)

    def transfers(
        self, *, limit: int, offset: int, seed_id: str | None, outcome: str | None
    ) -> TransfersPage:
        """Ended assignments, newest first, with bytes, seconds and GB/s."""
        conds: list[Any] = [Lease.ended_at.is_not(None)]
        if seed_id is not None:
            conds.append(Lease.instance_id == seed_id)
        if outcome is not None:
            conds.append(Lease.outcome == outcome)
        with self.db.read() as s:
            total = s.scalar(select(func.count()).select_from(Lease).where(*conds)) or 0
            rows = s.scalars(
                select(Lease)
                .where(*conds)
                .order_by(Lease.ended_at.desc(), Lease.id)
                .limit(limit)
                .offset(offset)
            ).all()
        items = [
            TransferView(
                id=r.id,
                seed_id=r.instance_id,
                rank=r.rank,
                requester_id=r.requester_id,
                identity_key=r.identity_key,
                provider=r.provider,
                created_at=r.created_at,
                ended_at=r.ended_at,
                outcome=r.outcome,
                bytes=r.bytes,
                seconds=r.seconds,
                gbps=(r.bytes / r.seconds / 1e9) if r.bytes and r.seconds else None,
                backend=r.backend,
                reason=r.reason,
                error=r.error,
            )
            for r in rows
        ]
        return TransfersPage(items=items, total=total)

    def status_counts(self) -> dict[str, int]:
        """Instances per status (for /metrics)."""
        with self.db.read() as s:
            return dict(s.execute(select(Instance.status, func.count()).group_by(Instance.status)).all())

    def live_leases(self, now: float) -> int:
        """Leases not ended and not expired."""
        with self.db.read() as s:
            return (
                s.scalar(
                    select(func.count())
                    .select_from(Lease)
                    .where(Lease.ended_at.is_(None), Lease.expires_at > now)
                )
                or 0
            )
