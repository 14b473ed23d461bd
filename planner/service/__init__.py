"""The planner's operations on the database: registration, lifecycle, manifests, assignments, reaper.

Functions take `now` (UNIX seconds) so tests can move time; routes pass time.time().
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from sqlalchemy import Connection, delete, func, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from planner import control_token, integrity, wire
from planner.auth import new_instance_token
from planner.burst import BusyEstimate, WaitingRoom, estimate_busy, pull_rate_bps
from planner.db import Database
from planner.errors import AllBusy, Conflict, DigestMismatch, NoSource, NotFound, PlannerError
from planner.models import Anchor, CompileCache, Instance, InstanceRank, Lease, Manifest
from planner.queries import HotStatements
from planner.selection import (
    Requester,
    SeedView,
    SelectionPolicy,
    choose_provider,
    make_policy,
    tier_key,
)
from planner.settings import PlannerSettings
from planner.wire import InstancePage, ModelsPage, ModelView, TransfersPage, TransferView

log = logging.getLogger(__name__)

ALLOWED: dict[str, frozenset[str]] = {
    "INITIALIZING": frozenset({"INITIALIZING", "LOADING", "READY", "DRAINING"}),
    "LOADING": frozenset({"LOADING", "READY", "DRAINING"}),
    "READY": frozenset({"READY", "DRAINING"}),
    "DRAINING": frozenset({"DRAINING"}),
    "STALE": frozenset({"LOADING", "READY", "DRAINING"}),
}
LIVE_STATUSES = ("INITIALIZING", "LOADING", "READY")
CHECKSUM_MISMATCH = "checksum_mismatch"
# report reasons that are the seed's fault (rfork.pull.planner_session sends them); any other reason
# (a loader's destination, engine, algorithm, ...) is recorded but never counts against the seed
SEED_FAULTS = frozenset({"transport", CHECKSUM_MISMATCH})


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
        "compile_cache_keys": [c.cache_key for c in inst.compile_caches],
    }


def instance_view(inst: Instance) -> wire.InstanceView:
    """The API view of an instance."""
    return wire.InstanceView(**_instance_fields(inst))


class Planner:
    """The service behind the routes: one per app, thread-safe (state lives in the database).

    Embedding it without HTTP (the simulator, tests): `Planner.open(settings)` on a migrated
    database (planner.db.migrate), then `close()`. Methods take `now` (UNIX seconds) and return
    planner.wire types; errors are planner.errors (NotFound, Conflict, NoSource, AllBusy, ...).
    """

    def __init__(self, *, db: Database, settings: PlannerSettings, policy: SelectionPolicy) -> None:
        self.db = db
        self.settings = settings
        self.policy = policy
        self._rank_bytes_cache: dict[tuple[str, int], int] = {}
        # the last 429 per request shape and its estimate's reads, kept while nothing changed
        # (`_still_busy`): (db.changes, now, busy seed) and (db.changes, now, lease starts, rate, bytes)
        self._busy: dict[tuple[Any, ...], tuple[int, float, str]] = {}
        self._busy_reads: dict[tuple[str, int], tuple[int, float, list[float], float, int]] = {}
        self.waiting = WaitingRoom()
        self._sql = HotStatements.build(db.engine.dialect)
        self._control_secret = settings.control_secret_bytes()

    @classmethod
    def open(cls, settings: PlannerSettings, *, policy: SelectionPolicy | None = None) -> Planner:
        """The service on `settings.db_url` (already migrated); `policy` None: settings.selection_policy."""
        return cls(
            db=Database(settings.db_url, pool_size=settings.db_pool_size),
            settings=settings,
            policy=policy or make_policy(settings.selection_policy),
        )

    def close(self) -> None:
        """Close the database connections."""
        self.db.close()

    # ---- instances -------------------------------------------------------------------------
    def register(
        self, body: wire.RegistrationRequest, now: float, *, may_anchor: bool = True, may_lease: bool = True
    ) -> wire.Registration:
        """Create an instance in INITIALIZING; returns its view plus its bearer token.

        `may_anchor`: its first disk publication of a rank sets the identity's anchor (the routes pass the
        registering token's anchor role; embedding code is its own authority). `may_lease`: its token may
        request assignments for its own identity (the routes pass the load role).
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
        with self.db.write() as s:
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
            if not _rowcount(s.execute(delete(Instance).where(Instance.id == instance_id))):
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

    # ---- manifests -------------------------------------------------------------------------
    def put_manifest(
        self, instance_id: str, rank: int, raw: str, now: float, manifest: wire.RankManifest | None = None
    ) -> bool:
        """Store a validated manifest verbatim (replaces any earlier one for that rank); True if it anchored.

        The first disk publication of an identity's rank by an instance allowed to anchor (registered
        with the anchor role) sets the anchor, unless an admin uploaded one; a manifest whose set differs
        from the anchor is refused (DigestMismatch, 409) and the instance is offered to nobody until it
        republishes clean: its memory no longer holds the identity's weights. A clean republication
        ends a re-verification (a disproved checksum report counts against its reporter).
        """
        if manifest is None:
            manifest = wire.RankManifest.model_validate_json(raw)
        algo = manifest.checksum_algorithm
        tensors = [t.model_dump() for t in manifest.tensors]
        dset = integrity.digest_set(algo, tensors)
        refused: str | None = None
        anchored = False
        disproved = 0
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
                    if inst.reverify_since is not None:
                        disproved = _rowcount(
                            s.execute(
                                update(Lease)
                                .where(
                                    Lease.instance_id == instance_id,
                                    Lease.reason == "checksum_mismatch",
                                    Lease.ended_at >= inst.reverify_since,
                                    Lease.disproved.is_(None),
                                )
                                .values(disproved=True)
                            )
                        )
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
        if disproved:
            log.warning(
                "integrity: instance %s re-verified clean; %d checksum report(s) disproved",
                instance_id,
                disproved,
            )
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

    # ---- anchors (admin) ---------------------------------------------------------------------
    def put_anchor(self, body: wire.AnchorUpload, now: float, *, set_by: str) -> wire.AnchorView:
        """Set (or replace) an identity's anchor for one rank and algorithm from an operator's digests."""
        ident = body.identity.model_dump()
        world = ident["tp"] * ident["pp"]
        if body.rank >= world:
            raise Conflict(f"rank: {body.rank} is outside the identity's tp*pp = {world}")
        names = [t.name for t in body.tensors]
        if len(set(names)) != len(names):
            raise Conflict("tensors: names must be unique")
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

    def list_anchors(self, *, identity_key: str | None, limit: int, offset: int) -> wire.AnchorsPage:
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
            return wire.AnchorsPage(items=[_anchor_view(a) for a in rows], total=total)

    def revoke_anchor(self, identity_key: str, rank: int, checksum_algorithm: str) -> None:
        """Delete an anchor: its identity's rank is served by nobody until an authority sets one again."""
        with self.db.write() as s:
            gone = _rowcount(
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

    # ---- assignments -----------------------------------------------------------------------
    def assign(
        self, body: wire.AssignmentRequest, now: float | None, holder: str | None = None
    ) -> wire.Assignment:
        """Lease the best free seed for one rank; the candidates carry their manifests as stored text.

        Raises NoSource (404) or AllBusy (429). Atomic across planner processes: the candidate seeds'
        rows are locked (PostgreSQL) or the whole write is serialised (SQLite) while leases are counted.
        `now` None (the routes): the clock is read once the write lock is held, so recorded lease times
        follow the order of the decisions (see `_now`).
        """
        with self.db.write_core() as s:  # Core on the hot path: no ORM session or unit of work
            answer = self.assign_in(s, body, now, holder)
        return answer()

    def assign_in(
        self, s: Connection, body: wire.AssignmentRequest, now: float | None, holder: str | None
    ) -> Callable[[], wire.Assignment]:
        """Planner.assign's write in the caller's transaction `s`; what it returns gives the answer (or
        raises NoSource or AllBusy) once `s` has committed: the 429's estimate reads in a transaction of
        its own, and the answer's encoding need not hold the write lock. Raises nothing itself but the
        database's errors (so a batch, Planner.write_batch, never has to undo one assignment's writes)."""
        key = body.identity.key()
        excluded = set(body.exclude)
        if body.requester_id:
            excluded.add(body.requester_id)
        st, sql = self.settings, self._sql
        clock = now is None
        now = _now(now)
        params: dict[str, Any] = {
            "b_key": key,
            "b_rank": body.rank,
            "b_oldest_beat": now - st.heartbeat_ttl_s,
            "b_now": now,
        }
        if excluded:
            params["b_excluded"] = sorted(excluded)
        hold = st.rack_hold and bool(body.labels.rack)
        shape: tuple[Any, ...] = (
            key,
            body.rank,
            frozenset(excluded),
            tuple(body.providers),
            tuple(body.backends),
        )
        if hold:
            shape += (body.labels.rack,)
        changes = self.db.changes
        busy_seed = self._still_busy(self._busy.get(shape), changes, now, s)
        if busy_seed is not None:
            return functools.partial(self._all_busy, key, body, busy_seed, now)
        req = Requester(
            node=body.labels.node,
            rack=body.labels.rack,
            zone=body.labels.zone,
            key=body.requester_id or body.labels.node,
        )
        ranked: Sequence[SeedView] = ()
        by_id: dict[str, tuple[Any, str]] = {}
        # rack_hold: the rack's seeds all busy -> wait for them (no read of the other racks' seeds)
        held = self._rack_busy(s, body, params, req.rack) if hold else None
        attempts = 0 if held else 3  # PostgreSQL: again if the chosen filled up before their locks
        for _attempt in range(attempts):
            free, busy_seed = self._free_seeds(s, req, body, params, bool(excluded))
            by_id = {r.id: (r, p) for r, p in free}
            ranked = self.policy.rank(req, [_seed_view(r) for r, _ in free])[: st.max_candidates]
            if not ranked or self.db.sqlite:  # SQLite: the write lock was held while they were counted
                break
            # PostgreSQL: lock the chosen rows (id order), then count their live leases again
            ids = [v.instance_id for v in ranked]
            locked = {r.id for r in sql.lock_chosen.rows(s, {**params, "b_ids": ids})}
            if clock:  # again, now that the row locks are held
                now = params["b_now"] = _now(None)
            live = sql.live_leases.rows(s, {"b_ids": ids, "b_rank": body.rank, "b_now": now})
            counts = Counter(r.instance_id for r in live)
            ranked = self.policy.rank(
                req,
                [replace(v, active_leases=counts[v.instance_id]) for v in ranked if v.instance_id in locked],
            )
            if ranked:
                break
            busy_seed = busy_seed or next(iter(by_id))
        if held:
            busy_seed = held
        if not ranked:  # the 429's arithmetic runs after the write: heartbeats and other writes go on
            if busy_seed is None:
                return _raising(NoSource(f"no READY source for identity {key[:12]} rank {body.rank}"))
            if len(self._busy) > 4096:
                self._busy.clear()
            self._busy[shape] = (changes, now, busy_seed)
            return functools.partial(self._all_busy, key, body, busy_seed, now)
        lease_id = uuid.uuid4().hex
        expires_at = now + st.lease_ttl_s
        sql.insert_lease.run(
            s,
            {
                "id": lease_id,
                "instance_id": ranked[0].instance_id,
                "rank": body.rank,
                "identity_key": key,
                "requester_id": body.requester_id,
                "holder": holder,
                "provider": by_id[ranked[0].instance_id][1],
                "created_at": now,
                "expires_at": expires_at,
            },
        )
        chosen = [v.instance_id for v in ranked]
        details = {d.id: d for d in sql.chosen_details.rows(s, {"b_ids": chosen, "b_rank": body.rank})}
        return functools.partial(
            self._assignment, key, now, body, chosen, by_id, details, lease_id, expires_at
        )

    def _rack_busy(
        self, s: Connection, body: wire.AssignmentRequest, params: dict[str, Any], rack: str
    ) -> str | None:
        """rack_hold: a busy seed of the identity in `rack` to wait for when the rack has seeds that
        could serve this requester and none is free; None when one is free or the rack has none."""
        rows = self._sql.in_rack.rows(
            s, {**params, "b_excluded": params.get("b_excluded", []), "b_req_rack": rack, "b_limit": 16}
        )
        usable = [r for r in rows if choose_provider(body.providers, body.backends, r.backends)]
        if not usable or any(r.active < r.max_concurrent_pulls for r in usable):
            return None
        return str(usable[0].id)

    def _still_busy(
        self, last: tuple[int, float, str] | None, changes: int, now: float, s: Connection
    ) -> str | None:
        """The busy seed of the last 429 of this request's shape if it still holds: no write of this
        process changed rows since (nor this transaction, in a batch) and the clock moved less than
        `busy_cache_s`. A fleet started at once comes back as a herd whenever leases run late (they are
        due "now"): at 10,000 instances, thousands of 429s per 50 ms, each reading every seed of the
        identity. Only a 429 is answered this way, never a lease: a stale answer costs one more ask
        (another process's writes are seen after at most `busy_cache_s`)."""
        if last is None or not self._unchanged_since(last[0], last[1], changes, now):
            return None
        return last[2] if self.db.unchanged(s) else None

    def _unchanged_since(self, then_changes: int, then: float, changes: int, now: float) -> bool:
        """No write of this process changed rows since `then` and the clock moved less than
        `busy_cache_s` (the rule for reusing a 429 and its estimate's reads)."""
        return then_changes == changes and 0 <= now - then <= self.settings.busy_cache_s

    def write_batch(
        self, steps: Sequence[Callable[[Connection], Callable[[], T]]]
    ) -> Sequence[T | Exception]:
        """Run several hot writes (assign_in, report_in) in order and then each step's returned
        continuation; per step its result, or the PlannerError / PermissionError it raised (the steps
        raise those before writing anything, so one step's refusal undoes nothing of the others').

        SQLite serialises writers, so the batch is one transaction: one BEGIN IMMEDIATE, one commit and
        one lock hand-off for all of them, and each step's limits are counted after the steps before
        it. PostgreSQL gives each step a transaction of its own (the row locks of several assignments
        in one transaction could meet another worker's in the opposite order), in the same thread.
        Any other error is raised: on SQLite the whole batch rolled back.
        """
        done: list[Callable[[], T] | Exception] = []
        if self.db.sqlite:
            with self.db.write_core() as s:
                for step in steps:
                    done.append(_step(step, s))
        else:
            for step in steps:
                with self.db.write_core() as s:
                    done.append(_step(step, s))
        out: list[T | Exception] = []
        for d in done:
            if isinstance(d, Exception):
                out.append(d)
                continue
            try:
                out.append(d())
            except (PlannerError, PermissionError) as exc:
                out.append(exc)
        return out

    def _all_busy(
        self, key: str, body: wire.AssignmentRequest, busy_seed: str, now: float
    ) -> wire.Assignment:
        """Raise the 429 (AllBusy) with its estimate; `busy_seed`: one of the busy seeds."""
        est = self._busy_estimate(key, body, busy_seed, now)
        raise AllBusy(
            f"all sources for rank {body.rank} are at their pull limit; "
            f"a slot is expected in {est.retry_after_s:.2f} s",
            retry_after_s=est.retry_after_s,
            expected_pull_s=est.expected_pull_s,
            fallback=est.fallback,
        )

    def _assignment(
        self,
        key: str,
        now: float,
        body: wire.AssignmentRequest,
        chosen: Sequence[str],
        by_id: dict[str, Any],
        details: dict[str, Any],
        lease_id: str,
        expires_at: float,
    ) -> wire.Assignment:
        """The 201's body: the chosen candidates, a control token for the first."""
        candidates = []
        for iid in chosen:
            r, provider = by_id[iid]
            d = details[iid]
            token = (
                control_token.issue(
                    control_token.unseal(self._control_secret, iid, d.control_key),
                    lease_id=lease_id,
                    instance_id=iid,
                    rank=body.rank,
                    expires_at=expires_at,
                )
                if iid == chosen[0] and d.control_key
                else None
            )
            candidates.append(
                wire.Candidate(
                    instance_id=iid,
                    rank=body.rank,
                    provider=provider,
                    address=base64.b64encode(d.address).decode(),
                    backends=r.backends,
                    control_url=d.control_url,
                    labels=wire.Labels(node=r.node, rack=r.rack, zone=r.zone),
                    anchor=wire.Anchor(
                        checksum_algorithm=r.checksum_algorithm,
                        digest_set=r.digest_set,
                        instance_id=r.anchored_by,
                    ),
                    control_token=token,
                    manifest=wire.StoredManifest(d.body),  # as stored: never parsed here
                )
            )
        if body.waited_s > 0:  # it waited: its place in line is free for the others
            self.waiting.leave((key, body.rank), now - body.waited_s, _waiter_tie(body))
        return wire.Assignment(
            id=lease_id,
            expires_at=dt.datetime.fromtimestamp(expires_at, tz=dt.timezone.utc).isoformat(),
            expires_at_unix=expires_at,
            candidates=candidates,
        )

    def _free_seeds(
        self,
        s: Connection,
        req: Requester,
        body: wire.AssignmentRequest,
        params: dict[str, Any],
        excluded: bool,
    ) -> tuple[Sequence[tuple[Any, str]], str | None]:
        """The free seeds the policy must see, each with the transport for this requester, and a busy
        seed it could use (None if none, or if the free ones were not all read).

        The query returns free seeds first (a tiered policy's: in `tier_key` order), at most b_limit
        rows; the limit grows until the rows read hold every free seed, or, for a tiered policy, the
        whole tier of the `max_candidates`-th: what a decision reads grows with the free seeds near the
        requester, not with the fleet.
        """
        sql, k = self._sql, self.settings.max_candidates
        tiered = self.policy.tiered
        if tiered:
            stmt = sql.ranked_excluding if excluded else sql.ranked
            params = {**params, "b_node": req.node, "b_rack": req.rack, "b_zone": req.zone}
        else:
            stmt = sql.candidates_excluding if excluded else sql.candidates
        limit = max(16, 4 * k)
        while True:
            found = stmt.rows(s, {**params, "b_limit": limit})
            free: list[tuple[Any, str]] = []
            busy_seed, every_free = None, len(found) < limit
            for r in found:
                provider = choose_provider(body.providers, body.backends, r.backends)
                if r.active >= r.max_concurrent_pulls:
                    every_free = True  # free seeds sort first
                    if provider is not None:
                        busy_seed = r.id
                        break
                elif provider is not None:
                    free.append((r, provider))
            if every_free and (free or busy_seed is not None or len(found) < limit):
                return free, busy_seed
            # rows past the k-th free seed's tier cannot change the policy's first k
            if (
                tiered
                and len(free) >= k
                and tier_key(req, _seed_view(found[-1])) > tier_key(req, _seed_view(free[k - 1][0]))
            ):
                return free, None
            limit *= 4

    def compile_cache_sources(
        self, cache_key: str, now: float, *, may_lease: Callable[[str], bool], labels: wire.Labels
    ) -> wire.CompileCacheSources:
        """READY, unquarantined instances serving `cache_key` (same node, rack, zone first), each with a
        control token for one fetch (planner.control_token, a compile-cache grant: no weight session).

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

    def _busy_estimate(
        self, key: str, body: wire.AssignmentRequest, seed_id: str, now: float
    ) -> BusyEstimate:
        """planner.burst's estimate from the live leases on the identity's seeds and its recent pulls.

        Its own read transaction: the live leases' starts (one column) and the rate of the last
        `rate_window` successful pulls that ended within `rate_history_s`; reused while unchanged (as
        `_still_busy`). `seed_id`: a busy seed, for the rank's bytes.
        """
        st, sql = self.settings, self._sql
        params = {
            "b_key": key,
            "b_rank": body.rank,
            "b_oldest": now - st.rate_history_s,
            "b_window": st.rate_window,
            "b_now": now,
            "b_oldest_beat": now - st.heartbeat_ttl_s,
        }
        room = (key, body.rank)
        since = now - body.waited_s
        tie = _waiter_tie(body)
        changes = self.db.changes
        reads = self._busy_reads.get(room)
        if reads is None or not self._unchanged_since(reads[0], reads[1], changes, now):
            with self.db.read() as session:
                s = session.connection()
                recent = s.execute(sql.recent_pulls, params).all()
                if not recent:  # a new identity: what pulls of any identity achieved here
                    recent = s.execute(sql.recent_pulls_any, params).all()
                rank_bytes = self._rank_bytes(s, key, body.rank, seed_id)
                rate = pull_rate_bps(((r[0], r[1]) for r in recent), default_bps=st.assumed_pull_gbps * 1e9)
                starts = [r[0] for r in sql.live_starts.cursor(s, params).fetchall()]
            if len(self._busy_reads) > 4096:
                self._busy_reads.clear()
            reads = self._busy_reads[room] = (changes, now, starts, rate, rank_bytes)
        _, _, starts, rate, rank_bytes = reads
        est = estimate_busy(
            lease_starts=starts,
            rank_bytes=rank_bytes,
            rate_bps=rate,
            now=now,
            position=self.waiting.position(room, now, since, tie),
            serves_after=body.serves_after,
            fallback_s=body.fallback_s,
            min_s=st.retry_after_min_s,
            max_s=st.retry_after_max_s,
        )
        if not est.fallback:
            self.waiting.promise(room, now + est.retry_after_s, since, now=now, tie=tie)
        return est

    def _rank_bytes(self, s: Any, key: str, rank: int, instance_id: str) -> int:
        """Bytes of one rank of an identity (from a seed's manifest; fixed by the identity, so cached)."""
        cached = self._rank_bytes_cache.get((key, rank))
        if cached is not None:
            return cached
        raw = s.execute(
            select(Manifest.body).where(Manifest.instance_id == instance_id, Manifest.rank == rank)
        ).scalar()
        nbytes = wire.RankManifest.model_validate_json(raw).region_bytes if raw else 0
        if len(self._rank_bytes_cache) > 4096:
            self._rank_bytes_cache.clear()
        self._rank_bytes_cache[(key, rank)] = nbytes
        return nbytes

    def report(
        self, lease_id: str, body: wire.TransferReport, now: float | None, reporter: str | None = None
    ) -> wire.ReportAnswer:
        """End a lease with the pull's outcome; only a seed's faults count against it.

        `reporter` is the caller's Principal.holder (None: admin); only the lease's holder may report.
        A lease that has ended (reported, expired, released) is refused (Conflict). Failures whose reason
        is in SEED_FAULTS count: `transport` ones towards quarantine after `failure_threshold` in a row,
        a `checksum_mismatch` makes the seed re-verify (offered to nobody until it re-hashed its memory
        and republished, see put_manifest), so one report costs a healthy seed one re-verification, no
        more. Anything else (a loader's own destination, engine or algorithm) is recorded, not blamed.
        Lock order (PostgreSQL): the seed's instance row, then the lease (as delete and assign).
        """
        with self.db.write_core() as s:  # Core on the hot path: no ORM session or unit of work
            return self.report_in(s, lease_id, body, now, reporter)

    def report_in(
        self, s: Connection, lease_id: str, body: wire.TransferReport, now: float | None, reporter: str | None
    ) -> wire.ReportAnswer:
        """Planner.report in the caller's transaction `s`; its refusals (NotFound, PermissionError,
        Conflict) are raised before it writes anything (Planner.write_batch relies on that)."""
        quarantined = False
        now = _now(now)
        lease = self._live_lease(s, lease_id, reporter, now, "reports are refused")
        self._sql.end_lease.run(
            s,
            {
                "b_lease": lease_id,
                "b_ended_at": now,
                "b_outcome": body.outcome,
                "b_bytes": body.bytes,
                "b_seconds": body.seconds,
                "b_backend": body.backend or lease.provider,
                "b_reason": body.reason,
                "b_error": body.error,
            },
        )
        if body.outcome == "success":
            self._sql.seed_succeeded.run(s, {"b_seed": lease.instance_id})
        elif body.reason == CHECKSUM_MISMATCH and self._flagged(s, lease.holder):
            log.warning(
                "seed %s: checksum mismatch reported by %s ignored: %d of its claims were disproved",
                lease.instance_id,
                lease.holder,
                self.settings.false_report_threshold,
            )
        elif body.reason == CHECKSUM_MISMATCH:
            quarantined = True  # out of service until it re-verifies (not for quarantine_s)
            s.execute(
                update(Instance)
                .where(Instance.id == lease.instance_id, Instance.reverify_since.is_(None))
                .values(reverify_since=now)
            )
            log.warning(
                "seed %s: a checksum mismatch reported by %s; offered to nobody until it re-verifies",
                lease.instance_id,
                lease.holder,
            )
        elif body.reason in SEED_FAULTS:
            fails = s.execute(
                update(Instance)
                .where(Instance.id == lease.instance_id)
                .values(consecutive_failures=Instance.consecutive_failures + 1)
                .returning(Instance.consecutive_failures)
            ).scalar()
            if fails is not None and fails >= self.settings.failure_threshold:
                quarantined = True
                s.execute(
                    update(Instance)
                    .where(Instance.id == lease.instance_id)
                    .values(consecutive_failures=0, quarantined_until=now + self.settings.quarantine_s)
                )
                log.warning(
                    "seed %s quarantined for %.0fs after %d failed pull(s)",
                    lease.instance_id,
                    self.settings.quarantine_s,
                    fails,
                )
        return wire.ReportAnswer(id=lease_id, outcome=body.outcome, seed_quarantined=quarantined)

    def _live_lease(self, s: Connection, lease_id: str, holder: str | None, now: float, refused: str) -> Any:
        """The lease row, locked in the one lock order (PostgreSQL: the seed's instance row, then the
        lease, as assign and delete); NotFound, PermissionError (another holder; None: admin) or
        Conflict (ended or expired: `refused` says what is refused) otherwise. SQLite serialises
        writes, so there one read of the lease is enough."""
        if not self.db.sqlite:
            seed = self._sql.lease_seed.first(s, {"b_lease": lease_id})
            if seed is None:
                raise NotFound(f"assignment {lease_id} not found")
            self._sql.lock_seed.run(s, {"b_seed": seed.instance_id})
        lease = self._sql.live_lease.first(s, {"b_lease": lease_id})
        if lease is None:
            raise NotFound(f"assignment {lease_id} not found")
        if holder is not None and lease.holder != holder:
            raise PermissionError(f"assignment {lease_id} belongs to another requester")
        if lease.ended_at is not None or lease.expires_at <= now:
            raise Conflict(f"assignment {lease_id} has ended ({lease.outcome or 'expired'}); {refused}")
        return lease

    def renew(self, lease_id: str, now: float | None, holder: str | None) -> wire.LeaseRenewal:
        """Extend a live lease by lease_ttl_s from now (a long pull keeps its slot); its holder only
        (`holder` None: admin). Conflict once it has ended."""
        with self.db.write_core() as s:
            now = _now(now)
            lease = self._live_lease(s, lease_id, holder, now, "not renewed")
            expires_at = max(lease.expires_at, now + self.settings.lease_ttl_s)
            s.execute(update(Lease).where(Lease.id == lease_id).values(expires_at=expires_at))
        return wire.LeaseRenewal(id=lease_id, expires_at_unix=expires_at)

    def _flagged(self, s: Any, holder: str | None) -> bool:
        """True when `holder`'s checksum claims were disproved false_report_threshold times or more."""
        if holder is None:
            return False
        disproved = s.execute(
            select(func.count()).select_from(Lease).where(Lease.holder == holder, Lease.disproved.is_(True))
        ).scalar()
        return int(disproved or 0) >= self.settings.false_report_threshold

    def false_reports(self, holder: str) -> int:
        """Checksum-mismatch claims of `holder` that the seed's re-verification disproved."""
        with self.db.read() as s:
            return (
                s.scalar(
                    select(func.count())
                    .select_from(Lease)
                    .where(Lease.holder == holder, Lease.disproved.is_(True))
                )
                or 0
            )

    # ---- views -----------------------------------------------------------------------------
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


@dataclass(frozen=True)
class ReapResult:
    """What one reaper pass changed."""

    stale: int
    expired: int
    deleted: int = 0


def reap(db: Database, settings: PlannerSettings, now: float) -> ReapResult:
    """Mark silent instances STALE, end expired leases, and delete instances STALE for longer than
    stale_retention_s with their ranks and manifests (up to 32 MiB each); safe from several processes."""
    gone = _delete_retired(db, settings, now)
    with db.write() as s:
        stale = _rowcount(
            s.execute(
                update(Instance)
                .where(
                    Instance.status.in_(LIVE_STATUSES),
                    Instance.last_heartbeat < now - settings.heartbeat_ttl_s,
                )
                .values(status="STALE", updated_at=now)
            )
        )
        expired = _rowcount(
            s.execute(
                update(Lease)
                .where(Lease.ended_at.is_(None), Lease.expires_at <= now)
                .values(ended_at=now, outcome="expired")
            )
        )
    if stale or expired or gone:
        log.info(
            "reaper: %d instances STALE, %d leases expired, %d STALE instances deleted", stale, expired, gone
        )
    return ReapResult(stale=stale, expired=expired, deleted=gone)


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


def _anchor_view(a: Anchor) -> wire.AnchorView:
    return wire.AnchorView(
        identity_key=a.identity_key,
        rank=a.rank,
        checksum_algorithm=a.checksum_algorithm,
        digest_set=a.digest_set,
        tensors=len(a.digests),
        instance_id=a.instance_id,
        set_by=a.set_by,
        created_at=a.created_at,
    )


T = TypeVar("T")


def _step(step: Callable[[Connection], Callable[[], T]], s: Connection) -> Callable[[], T] | Exception:
    try:
        return step(s)
    except (PlannerError, PermissionError) as exc:
        return exc


def _raising(exc: Exception) -> Callable[[], Any]:
    """A continuation that raises `exc` (a refusal decided inside the write, raised after it)."""

    def answer() -> Any:
        raise exc

    return answer


def _waiter_tie(body: wire.AssignmentRequest) -> str:
    """Orders waiters that started at the same instant (planner.burst.WaitingRoom): the requester."""
    return body.requester_id or body.labels.node


def _seed_view(r: Any) -> SeedView:
    """A candidate row (planner.queries' candidates) as the policy sees it."""
    return SeedView(
        instance_id=r.id,
        node=r.node,
        rack=r.rack,
        zone=r.zone,
        active_leases=r.active,
        max_concurrent_pulls=r.max_concurrent_pulls,
    )


def _now(now: float | None) -> float:
    """`now`, or the clock read now: call it with the write lock held. A time read before waiting for
    the lock could predate a lease end that the decision already saw, and the record would show a seed
    over its limit that never was."""
    return time.time() if now is None else now


def _rowcount(result: Any) -> int:
    return int(getattr(result, "rowcount", 0) or 0)
