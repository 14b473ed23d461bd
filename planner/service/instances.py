"""Instances: registration, lookup, lifecycle, heartbeats and removal (routes/instances.py)."""

from __future__ import annotations

import base64
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, func, select, update

from planner.auth import new_instance_token
from planner.contract import control_token, wire
from planner.contract.errors import Conflict, NotFound
from planner.contract.views import InstancePage
from planner.models import CompileCache, Instance, InstanceRank, Lease, Manifest
from planner.service.base import ServiceState, rowcount

log = logging.getLogger(__name__)

ALLOWED: dict[str, frozenset[str]] = {
    "INITIALIZING": frozenset({"INITIALIZING", "LOADING", "READY", "DRAINING"}),
    "LOADING": frozenset({"LOADING", "READY", "DRAINING"}),
    "READY": frozenset({"READY", "DRAINING"}),
    "DRAINING": frozenset({"DRAINING"}),
    "STALE": frozenset({"LOADING", "READY", "DRAINING"}),
}
LIVE_STATUSES = ("INITIALIZING", "LOADING", "READY")


def _instance_fields(inst: Instance) -> dict[str, Any]:
    """The fields of an instance's API view (wire.InstanceView)."""
    return {
        "id": inst.id,
        "identity_key": inst.identity_key,
        "identity": inst.identity,
        "labels": wire.Labels(node=inst.node, rack=inst.rack, zone=inst.zone),
        "control_url": inst.control_url,
        "ranks": [
            wire.RankView(
                rank=r.rank,
                provider=r.provider,
                address=base64.b64encode(r.address).decode(),
                backends=r.backends,
            )
            for r in inst.ranks
        ],
        "max_concurrent_pulls": inst.max_concurrent_pulls,
        "status": inst.status,
        "created_at": inst.created_at,
        "updated_at": inst.updated_at,
        "last_heartbeat": inst.last_heartbeat,
        "quarantined_until": inst.quarantined_until,
        "reverifying": inst.reverify_since is not None,
        "integrity_failed": bool(inst.integrity_failed),
        "accused": inst.accused_since is not None,
        "compile_cache_keys": [c.cache_key for c in inst.compile_caches],
    }


def instance_view(inst: Instance) -> wire.InstanceView:
    """The API view of an instance."""
    return wire.InstanceView(**_instance_fields(inst))


class InstanceOps(ServiceState):
    """Planner's operations on instances."""

    def register(
        self,
        body: wire.RegistrationRequest,
        now: float,
        *,
        may_anchor: bool = True,
        may_lease: bool = True,
        registered_by: str | None = None,
    ) -> wire.Registration:
        """Create an instance in INITIALIZING; returns its view plus its bearer token.

        `may_anchor`: its first disk publication of a rank sets the identity's anchor (the routes pass the
        registering token's anchor role; embedding code is its own authority). `may_lease`: its token may
        request assignments for its own identity (the routes pass the load role). `registered_by`: the
        registering credential (Principal.holder): its instances count as one witness, and it may have
        at most max_instances_per_credential of them (Conflict past that; "admin" and None: unbounded).
        """
        token, digest = new_instance_token()
        ident = body.identity.model_dump()
        inst = Instance(
            id=uuid.uuid4().hex,
            identity_key=wire.identity_key(ident),
            identity=ident,
            model=body.identity.model,
            fingerprint=body.identity.fingerprint,
            node=body.labels.node,
            rack=body.labels.rack,
            zone=body.labels.zone,
            control_url=body.control_url,
            control_key=None,  # sealed below, once the id is known
            may_anchor=may_anchor,
            may_lease=may_lease,
            status="INITIALIZING",
            max_concurrent_pulls=body.max_concurrent_pulls,
            token_hash=digest,
            created_at=now,
            updated_at=now,
            last_heartbeat=now,
            consecutive_failures=0,
            ranks=[
                InstanceRank(
                    rank=r.rank,
                    provider=r.provider,
                    address=base64.b64decode(r.address),
                    backends=list(r.backends) or [r.provider],
                )
                for r in body.ranks
            ],
            compile_caches=[CompileCache(cache_key=k) for k in body.compile_cache_keys],
        )
        if body.control_key:
            inst.control_key = control_token.seal(self._control_secret, inst.id, body.control_key)
        inst.registered_by = registered_by
        bound = self.settings.max_instances_per_credential
        with self.db.write() as s:
            if registered_by not in (None, "admin"):
                held = s.scalar(
                    select(func.count()).select_from(Instance).where(Instance.registered_by == registered_by)
                )
                if (held or 0) >= bound:
                    raise Conflict(
                        f"this credential has registered {held} instances, the most one credential may"
                        f" have (max_instances_per_credential = {bound}); delete some or use another token",
                        reason="registration_limit",
                    )
            s.add(inst)
        log.info("registered instance %s model=%s ranks=%d", inst.id, inst.model, len(inst.ranks))
        return wire.Registration(**_instance_fields(inst), token=token)

    def get(self, instance_id: str) -> wire.InstanceView:
        """One instance's view; NotFound if absent."""
        with self.db.read() as s:
            inst = s.get(Instance, instance_id)
            if inst is None:
                raise NotFound(f"instance {instance_id} not found")
            return instance_view(inst)

    def list(
        self,
        *,
        model: str | None,
        fingerprint: str | None,
        status: str | None,
        node: str | None,
        identity_key: str | None,
        limit: int,
        offset: int,
    ) -> InstancePage:
        """A filtered page of instances, oldest first, with the total count."""
        conds = []
        for col, val in (
            (Instance.model, model),
            (Instance.fingerprint, fingerprint),
            (Instance.status, status),
            (Instance.node, node),
            (Instance.identity_key, identity_key),
        ):
            if val is not None:
                conds.append(col == val)
        with self.db.read() as s:
            total = s.scalar(select(func.count()).select_from(Instance).where(*conds)) or 0
            rows = s.scalars(
                select(Instance)
                .where(*conds)
                .order_by(Instance.created_at, Instance.id)
                .limit(limit)
                .offset(offset)
            ).all()
            return InstancePage(items=[instance_view(i) for i in rows], total=total)

    def delete(self, instance_id: str, now: float) -> None:
        """Remove an instance, its ranks and manifests; its live leases end (its transfer history stays).

        Lock order (PostgreSQL), the same in every write: the instance row first, then its leases.
        """
        with self.db.write() as s:
            if not self.db.sqlite:
                s.execute(select(Instance.id).where(Instance.id == instance_id).with_for_update())
            s.execute(delete(Manifest).where(Manifest.instance_id == instance_id))
            s.execute(delete(InstanceRank).where(InstanceRank.instance_id == instance_id))
            if not rowcount(s.execute(delete(Instance).where(Instance.id == instance_id))):
                raise NotFound(f"instance {instance_id} not found")
            s.execute(
                update(Lease)
                .where(Lease.instance_id == instance_id, Lease.ended_at.is_(None))
                .values(ended_at=now, outcome="released")
            )

    def set_status(self, instance_id: str, status: str, now: float) -> wire.InstanceView:
        """Move along the lifecycle; Conflict (409) for an illegal transition."""
        with self.db.write() as s:
            inst = s.get(Instance, instance_id, with_for_update=True)
            if inst is None:
                raise NotFound(f"instance {instance_id} not found")
            if status not in ALLOWED[inst.status]:
                raise Conflict(
                    f"status: illegal transition {inst.status} -> {status} for instance {instance_id}"
                )
            inst.status = status
            inst.updated_at = now
            inst.last_heartbeat = now
            s.flush()
            return instance_view(inst)

    def heartbeat(self, instance_id: str, now: float) -> wire.HeartbeatAnswer:
        """Record liveness; a STALE instance stays STALE until it sets a status."""
        with self.db.write() as s:
            row = s.execute(
                update(Instance)
                .where(Instance.id == instance_id)
                .values(last_heartbeat=now)
                .returning(Instance.status, Instance.reverify_since)
            ).first()
        if row is None:
            raise NotFound(f"instance {instance_id} not found")
        return wire.HeartbeatAnswer(
            status=wire.InstanceStatus(row[0]),
            ttl_s=self.settings.heartbeat_ttl_s,
            reverify=row[1] is not None,
        )

    def heartbeat_many(self, instance_ids: Sequence[str], now: float) -> dict[str, tuple[str, bool]]:
        """Heartbeats of many instances in one transaction; {id: (status, reverify)} for those that exist."""
        out: dict[str, tuple[str, bool]] = {}
        with self.db.write_core() as s:
            for i in range(0, len(instance_ids), 500):
                rows = self._sql.heartbeats.rows(s, {"b_ids": instance_ids[i : i + 500], "b_now": now})
                out.update({r[0]: (r[1], r[2] is not None) for r in rows})
        return out
