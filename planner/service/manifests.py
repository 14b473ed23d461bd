"""Rank manifests and the anchors they are checked against (routes/instances.py, routes/anchors.py).

The first disk publication of an identity's rank anchors its digest set (planner.contract.integrity);
a later manifest whose set differs is refused. Admins may upload, list and revoke anchors.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from planner.contract import integrity, views, wire
from planner.contract.errors import Conflict, DigestMismatch, NotFound
from planner.contract.manifest import stripes_conflict
from planner.models import Anchor, Instance, Manifest
from planner.service.base import ServiceState, rowcount

log = logging.getLogger(__name__)

SHARED_SCAN = 1000  # anchors a shared-identities query compares (the most recent ones)


class ManifestOps(ServiceState):
    """Planner's operations on manifests and anchors."""

    def put_manifest(
        self, instance_id: str, rank: int, raw: str, now: float, manifest: wire.RankManifest | None = None
    ) -> bool:
        """Store a validated manifest verbatim (replaces any earlier one for that rank); True if it anchored.

        The first disk publication of an identity's rank by an instance allowed to anchor (registered
        with the anchor role) sets the anchor, unless an admin uploaded one; a manifest whose set differs
        from the anchor is refused (DigestMismatch, 409) and the instance is offered to nobody until it
        republishes clean: its memory no longer holds the identity's weights. A clean republication
        ends a re-verification, not an accusation: only another loader's verified pull disproves a
        checksum report (planner.service.reports).
        """
        if manifest is None:
            manifest = wire.RankManifest.model_validate_json(raw)
        algo = manifest.checksum_algorithm
        tensors = [t.model_dump() for t in manifest.tensors]
        dset = integrity.digest_set(algo, tensors)
        refused: str | None = None
        anchored = False
        rehashed = False
        with self.db.write() as s:
            inst = s.get(Instance, instance_id, with_for_update=not self.db.sqlite)
            if inst is None:
                raise NotFound(f"instance {instance_id} not found")
            world = inst.identity["tp"] * inst.identity["pp"]
            if rank >= world:
                raise Conflict(f"rank: {rank} is outside this instance's tp*pp = {world}")
            ikey = inst.identity_key
            anchor = s.get(Anchor, (ikey, rank, algo))
            if anchor is None and manifest.origin == "disk" and inst.may_anchor:
                anchor, anchored = self._anchor_once(
                    s,
                    ikey,
                    rank,
                    algo,
                    dset,
                    tensors,
                    now,
                    instance_id=instance_id,
                    set_by="instance:" + instance_id,
                )
            if anchor is not None and anchor.digest_set != dset:
                refused = integrity.first_difference(anchor.digests, integrity.digests(tensors))
                inst.integrity_failed = True
                inst.reverify_since = None
                s.execute(delete(Manifest).where(Manifest.instance_id == instance_id, Manifest.rank == rank))
            if refused is None:
                row = s.get(Manifest, (instance_id, rank))
                if row is None:
                    row = Manifest(instance_id=instance_id, rank=rank)
                    s.add(row)
                row.body, row.nbytes, row.updated_at = raw, len(raw), now
                row.checksum_algorithm, row.digest_set = algo, dset
                if anchor is not None and (inst.reverify_since is not None or inst.integrity_failed):
                    # re-hashed clean: it may take probation pulls again; an accusation stands until one
                    # of them verifies (planner.service.reports), never on its own word
                    rehashed = True
                    inst.reverify_since = None
                    inst.integrity_failed = False
        if refused is not None:
            log.warning(
                "integrity: instance %s published rank %d of identity %s whose digests differ from the "
                "anchor (%s); manifest refused, instance offered to nobody until it republishes clean",
                instance_id,
                rank,
                ikey[:12],
                refused,
            )
            raise DigestMismatch(
                f"manifest rank {rank}: digests differ from the identity's anchored set ({refused});"
                f" instance {instance_id} is offered to nobody until it republishes clean"
            )
        if rehashed:
            log.info("integrity: instance %s republished rank %d matching the anchor", instance_id, rank)
        if anchored:
            log.info("integrity: identity %s rank %d anchored by %s", ikey[:12], rank, instance_id)
        return anchored

    def _anchor_once(
        self,
        s: Any,
        ikey: str,
        rank: int,
        algo: str,
        dset: str,
        tensors: Sequence[dict[str, Any]],
        now: float,
        *,
        instance_id: str,
        set_by: str,
    ) -> tuple[Anchor, bool]:
        """Insert the anchor unless one exists (INSERT ... ON CONFLICT DO NOTHING), then read it back:
        concurrent first publications on PostgreSQL end with one anchor and no error. (anchor, inserted)."""
        values = {
            "identity_key": ikey,
            "rank": rank,
            "checksum_algorithm": algo,
            "digest_set": dset,
            "digests": integrity.digests(tensors),
            "instance_id": instance_id,
            "created_at": now,
            "set_by": set_by,
        }
        stmt = (sqlite_insert if self.db.sqlite else pg_insert)(Anchor).values(**values)
        # RETURNING says whether this insert won (rowcount is -1 here on psycopg); through the connection:
        # Core, not the ORM's bulk-insert path
        won = stmt.on_conflict_do_nothing().returning(Anchor.identity_key)
        inserted = s.connection().execute(won).first() is not None
        anchor = s.execute(
            select(Anchor)
            .where(Anchor.identity_key == ikey, Anchor.rank == rank, Anchor.checksum_algorithm == algo)
            .execution_options(populate_existing=True)
        ).scalar_one()
        return anchor, inserted

    def put_anchor(self, body: wire.AnchorUpload, now: float, *, set_by: str) -> views.AnchorView:
        """Set (or replace) an identity's anchor for one rank and algorithm from an operator's digests."""
        ident = body.identity.model_dump()
        world = ident["tp"] * ident["pp"]
        if body.rank >= world:
            raise Conflict(f"rank: {body.rank} is outside the identity's tp*pp = {world}")
        names = [t.name for t in body.tensors]
        if len(set(names)) != len(names):
            raise Conflict("tensors: names must be unique")
        for i, t in enumerate(body.tensors):
            bad = stripes_conflict(t.shape, t.stripes)
            if bad is not None:
                raise Conflict(f"tensors[{i}]: {bad}")
        ikey = wire.identity_key(ident)
        tensors = [t.model_dump() for t in body.tensors]
        dset = integrity.digest_set(body.checksum_algorithm, tensors)
        with self.db.write() as s:
            s.execute(
                delete(Anchor).where(
                    Anchor.identity_key == ikey,
                    Anchor.rank == body.rank,
                    Anchor.checksum_algorithm == body.checksum_algorithm,
                )
            )
            anchor, _ = self._anchor_once(
                s, ikey, body.rank, body.checksum_algorithm, dset, tensors, now, instance_id="", set_by=set_by
            )
            view = _anchor_view(anchor)
        log.info("integrity: identity %s rank %d anchored by %s (upload)", ikey[:12], body.rank, set_by)
        return view

    def list_anchors(self, *, identity_key: str | None, limit: int, offset: int) -> views.AnchorsPage:
        """Anchors, oldest first (optionally of one identity)."""
        conds = [] if identity_key is None else [Anchor.identity_key == identity_key]
        with self.db.read() as s:
            total = s.scalar(select(func.count()).select_from(Anchor).where(*conds)) or 0
            rows = s.scalars(
                select(Anchor)
                .where(*conds)
                .order_by(Anchor.created_at, Anchor.identity_key, Anchor.rank, Anchor.checksum_algorithm)
                .limit(limit)
                .offset(offset)
            ).all()
            return views.AnchorsPage(items=[_anchor_view(a) for a in rows], total=total)

    def shared_identities(
        self, identity_key: str, *, rank: int, checksum_algorithm: str, limit: int
    ) -> views.SharedPage:
        """Other identities with READY instances whose anchor of this rank and algorithm shares tensors
        (equal name and digest) with this identity's, most shared first; none if it has no anchor.

        Looks at the SHARED_SCAN most recently anchored identities (a rank's digests are a JSON column:
        the comparison runs here, not in SQL)."""
        with self.db.read() as s:
            mine = s.get(Anchor, (identity_key, rank, checksum_algorithm))
            if mine is None:
                return views.SharedPage(items=[])
            wanted = set(mine.digests.items())
            others = s.scalars(
                select(Anchor)
                .where(
                    Anchor.rank == rank,
                    Anchor.checksum_algorithm == checksum_algorithm,
                    Anchor.identity_key != identity_key,
                )
                .order_by(Anchor.created_at.desc())
                .limit(SHARED_SCAN)
            ).all()
            shared = {a.identity_key: sum(1 for pair in a.digests.items() if pair in wanted) for a in others}
            keys = [k for k, n in shared.items() if n]
            ready: dict[str, tuple[int, dict[str, Any]]] = {}
            if keys:
                rows = s.execute(
                    select(Instance.identity_key, Instance.identity).where(
                        Instance.identity_key.in_(keys), Instance.status == "READY"
                    )
                ).all()
                for k, ident in rows:
                    ready[k] = (ready[k][0] + 1 if k in ready else 1, ident)
        items = [
            views.SharedIdentity(
                identity=wire.SourceIdentity(**ready[k][1]),
                identity_key=k,
                shared_tensors=shared[k],
                ready=ready[k][0],
            )
            for k in keys
            if k in ready
        ]
        items.sort(key=lambda i: (-i.shared_tensors, -i.ready, i.identity_key))
        return views.SharedPage(items=items[:limit])

    def revoke_anchor(self, identity_key: str, rank: int, checksum_algorithm: str) -> None:
        """Delete an anchor: its identity's rank is served by nobody until an authority sets one again."""
        with self.db.write() as s:
            gone = rowcount(
                s.execute(
                    delete(Anchor).where(
                        Anchor.identity_key == identity_key,
                        Anchor.rank == rank,
                        Anchor.checksum_algorithm == checksum_algorithm,
                    )
                )
            )
        if not gone:
            raise NotFound(f"no anchor for identity {identity_key[:12]} rank {rank} ({checksum_algorithm})")
        log.warning(
            "integrity: anchor of identity %s rank %d (%s) revoked",
            identity_key[:12],
            rank,
            checksum_algorithm,
        )

    def get_manifest(self, instance_id: str, rank: int) -> str:
        """The manifest text as stored; NotFound if absent."""
        with self.db.read() as s:
            body = s.scalar(
                select(Manifest.body).where(Manifest.instance_id == instance_id, Manifest.rank == rank)
            )
        if body is None:
            raise NotFound(f"no manifest for instance {instance_id} rank {rank}")
        return body


def _anchor_view(a: Anchor) -> views.AnchorView:
    return views.AnchorView(
        identity_key=a.identity_key,
        rank=a.rank,
        checksum_algorithm=a.checksum_algorithm,
        digest_set=a.digest_set,
        tensors=len(a.digests),
        instance_id=a.instance_id,
        set_by=a.set_by,
        created_at=a.created_at,
    )
