"""The hot paths' SQL (assignment, report, heartbeat), built once per database kind.

Building a SQLAlchemy statement and computing its cache key took more CPU than running it on SQLite
(profile in docs/planner.md): a statement object built once memoises its cache key, so the hot paths
reuse these objects and pass every value as a bound parameter. Bound names start with `b_` (a name
equal to a column's is reserved by UPDATE ... VALUES).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Float, String, and_, bindparam, case, cast, func, insert, literal, or_, select, update

from planner.models import Anchor, Instance, InstanceRank, Lease, Manifest


def _serves(*, excluding: bool) -> list[Any]:
    """Conditions of a seed that may serve (b_key, b_rank): READY, fresh, unquarantined, not re-verifying."""
    conds = [
        Instance.identity_key == bindparam("b_key"),
        Instance.status == "READY",
        Instance.last_heartbeat >= bindparam("b_oldest_beat"),
        or_(Instance.quarantined_until.is_(None), Instance.quarantined_until <= bindparam("b_now")),
        Instance.reverify_since.is_(None),
        Instance.integrity_failed.is_(False),
    ]
    if excluding:
        conds.append(Instance.id.not_in(bindparam("b_excluded", expanding=True)))
    return conds


def _live_per_seed() -> Any:
    """Live leases of (b_key, b_rank) per seed: one grouped pass over the identity's leases, joined to
    the candidates (a correlated count would run once per seed and per use in the ORDER BY)."""
    return (
        select(Lease.instance_id, func.count().label("n"))
        .where(
            Lease.identity_key == bindparam("b_key"),
            Lease.rank == bindparam("b_rank"),
            Lease.ended_at.is_(None),
            Lease.expires_at > bindparam("b_now"),
        )
        .group_by(Lease.instance_id)
        .subquery("live")
    )


def _candidates(*, excluding: bool, tiered: bool) -> Any:
    """The seeds of (b_key, b_rank) whose manifest matches the identity's anchor, free ones first,
    with their live leases (`active`); at most b_limit rows.

    `tiered` (the load-aware policy): the free ones nearest to the requester (b_node, b_rack, b_zone)
    and least loaded first, the order of `LoadAwarePolicy.rank` up to its hash tie-break, so a decision
    reads the best tier and not every seed (planner.selection.LoadAwarePolicy). Otherwise by id: the
    policy ranks every free seed.
    """
    live = _live_per_seed()
    active = func.coalesce(live.c.n, 0)
    busy = case((active >= Instance.max_concurrent_pulls, 1), else_=0)
    order: list[Any] = [busy]
    if tiered:
        # topology_distance: 0 same node, 1 same rack, 2 same zone, 3 elsewhere; empty labels never match
        node, rack, zone = (bindparam(f"b_{label}", type_=String) for label in ("node", "rack", "zone"))
        distance = case(
            (and_(node != literal(""), Instance.node == node), 0),
            (and_(rack != literal(""), Instance.rack == rack), 1),
            (and_(zone != literal(""), Instance.zone == zone), 2),
            else_=3,
        )
        order += [distance, cast(active, Float) / cast(Instance.max_concurrent_pulls, Float)]
    return (
        select(
            Instance.id,
            Instance.node,
            Instance.rack,
            Instance.zone,
            Instance.max_concurrent_pulls,
            active.label("active"),
            InstanceRank.backends,
            Anchor.checksum_algorithm,
            Anchor.digest_set,
            Anchor.instance_id.label("anchored_by"),
        )
        .join(
            InstanceRank,
            and_(InstanceRank.instance_id == Instance.id, InstanceRank.rank == bindparam("b_rank")),
        )
        .join(Manifest, and_(Manifest.instance_id == Instance.id, Manifest.rank == bindparam("b_rank")))
        # only manifests matching the identity's anchored digest set are served
        .join(
            Anchor,
            and_(
                Anchor.identity_key == Instance.identity_key,
                Anchor.rank == bindparam("b_rank"),
                Anchor.checksum_algorithm == Manifest.checksum_algorithm,
                Anchor.digest_set == Manifest.digest_set,
            ),
        )
        .outerjoin(live, live.c.instance_id == Instance.id)
        .where(*_serves(excluding=excluding))
        .order_by(*order, Instance.id)
        .limit(bindparam("b_limit"))
    )


def _live_starts(*, count: bool, started: str = "") -> Any:
    """The live leases of (b_key, b_rank) on seeds that may serve it: how many (`count`; `started`
    "<=" or "<": of those that started so before b_at), else the start of the b_offset-th earliest
    (what the 429's estimate reads instead of every lease)."""
    q = (
        select(func.count() if count else Lease.created_at)
        .select_from(Lease)
        .join(Instance, Instance.id == Lease.instance_id)
    )
    q = q.where(
        Lease.identity_key == bindparam("b_key"),
        Lease.rank == bindparam("b_rank"),
        Lease.ended_at.is_(None),
        Lease.expires_at > bindparam("b_now"),
        *_serves(excluding=False),
    )
    if started:
        at: Any = bindparam("b_at")
        q = q.where(Lease.created_at <= at if started == "<=" else Lease.created_at < at)
    if count:
        return q
    return q.order_by(Lease.created_at).limit(1).offset(bindparam("b_offset"))


def _recent_pulls(*, of_identity: bool) -> Any:
    """(bytes, seconds) of the b_window newest successful pulls that started and ended after b_oldest
    (of identity b_key and rank b_rank, or of any identity: what a new identity's estimate uses)."""
    conds = [
        Lease.outcome == "success",
        Lease.created_at >= bindparam("b_oldest"),
        Lease.ended_at >= bindparam("b_oldest"),
    ]
    if of_identity:
        conds += [Lease.identity_key == bindparam("b_key"), Lease.rank == bindparam("b_rank")]
    return (
        select(Lease.bytes, Lease.seconds)
        .where(*conds)
        .order_by(Lease.ended_at.desc())
        .limit(bindparam("b_window"))
    )


@dataclass(frozen=True)
class HotStatements:
    """The statements of assign, report and the heartbeat flush; `lock`: PostgreSQL's row locks."""

    candidates: Any
    candidates_excluding: Any
    ranked: Any
    ranked_excluding: Any
    lock_chosen: Any
    live_leases: Any
    live_count: Any
    live_count_le: Any
    live_count_lt: Any
    live_start: Any
    recent_pulls: Any
    recent_pulls_any: Any
    insert_lease: Any
    chosen_details: Any
    lease_seed: Any
    lock_seed: Any
    live_lease: Any
    end_lease: Any
    seed_succeeded: Any
    heartbeats: Any

    @classmethod
    def build(cls, *, lock: bool) -> HotStatements:
        """The statements for SQLite (`lock` False: writes are serialised) or PostgreSQL (`lock` True)."""
        live_lease = select(
            Lease.instance_id,
            Lease.holder,
            Lease.outcome,
            Lease.ended_at,
            Lease.expires_at,
            Lease.provider,
        ).where(Lease.id == bindparam("b_lease"))
        return cls(
            candidates=_candidates(excluding=False, tiered=False),
            candidates_excluding=_candidates(excluding=True, tiered=False),
            ranked=_candidates(excluding=False, tiered=True),
            ranked_excluding=_candidates(excluding=True, tiered=True),
            # PostgreSQL: the chosen seeds' rows, locked in id order, still serving, while their live
            # leases are counted again and the new one inserted (SQLite serialises the whole write)
            lock_chosen=select(Instance.id)
            .where(Instance.id.in_(bindparam("b_ids", expanding=True)), *_serves(excluding=False))
            .order_by(Instance.id)
            .with_for_update(),
            # the chosen seeds' live leases, counted against their limits under those locks
            live_leases=select(Lease.instance_id).where(
                Lease.instance_id.in_(bindparam("b_ids", expanding=True)),
                Lease.rank == bindparam("b_rank"),
                Lease.ended_at.is_(None),
                Lease.expires_at > bindparam("b_now"),
            ),
            live_count=_live_starts(count=True),
            live_count_le=_live_starts(count=True, started="<="),
            live_count_lt=_live_starts(count=True, started="<"),
            live_start=_live_starts(count=False),
            recent_pulls=_recent_pulls(of_identity=True),
            recent_pulls_any=_recent_pulls(of_identity=False),
            insert_lease=insert(Lease),
            # what the answer needs of the chosen few only (the ranking needs none of it)
            chosen_details=select(
                Instance.id, Instance.control_url, Instance.control_key, InstanceRank.address, Manifest.body
            )
            .join(
                InstanceRank,
                and_(InstanceRank.instance_id == Instance.id, InstanceRank.rank == bindparam("b_rank")),
            )
            .join(Manifest, and_(Manifest.instance_id == Instance.id, Manifest.rank == bindparam("b_rank")))
            .where(Instance.id.in_(bindparam("b_ids", expanding=True))),
            lease_seed=select(Lease.instance_id).where(Lease.id == bindparam("b_lease")),
            lock_seed=select(Instance.id).where(Instance.id == bindparam("b_seed")).with_for_update(),
            live_lease=live_lease.with_for_update() if lock else live_lease,
            end_lease=update(Lease)
            .where(Lease.id == bindparam("b_lease"))
            .values(
                ended_at=bindparam("b_ended_at"),
                outcome=bindparam("b_outcome"),
                bytes=bindparam("b_bytes"),
                seconds=bindparam("b_seconds"),
                backend=bindparam("b_backend"),
                reason=bindparam("b_reason"),
                error=bindparam("b_error"),
            ),
            seed_succeeded=update(Instance)
            .where(Instance.id == bindparam("b_seed"), Instance.consecutive_failures != 0)
            .values(consecutive_failures=0),
            heartbeats=update(Instance)
            .where(Instance.id.in_(bindparam("b_ids", expanding=True)))
            .values(last_heartbeat=bindparam("b_now"))
            .returning(Instance.id, Instance.status, Instance.reverify_since),
        )
