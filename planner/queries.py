"""The hot paths' SQL (assignment, report, heartbeat), compiled once per database and run on the driver.

Building a SQLAlchemy statement and computing its cache key took more CPU than running it on SQLite,
and so did SQLAlchemy's per-execution work on a prebuilt one (parameter processing, execution context,
result rows: profile in docs/planner.md). So the hot statements are written with SQLAlchemy once, compiled
once for the database's dialect, and executed on the DBAPI cursor of the SQLAlchemy connection's
transaction (`RawStatement`). Bound names start with `b_` (a name equal to a column's is reserved by
UPDATE ... VALUES). The drivers are sqlite3 and psycopg 3.
"""

from __future__ import annotations

import re
from collections import namedtuple
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import (
    JSON,
    Boolean,
    Connection,
    Float,
    String,
    and_,
    bindparam,
    case,
    cast,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Dialect

from planner.models import Anchor, Instance, InstanceRank, Lease, Manifest

# where SQLAlchemy leaves an expanding (list) parameter for execution time: `[NOT] IN (__[POSTCOMPILE_x])`
_EXPANDING = re.compile(r"(NOT )?IN \(__\[POSTCOMPILE_(\w+)\]\)")


class RawStatement:
    """A statement compiled once for one dialect, executed on the DBAPI cursor with the driver's own
    parameter handling; rows come back as named tuples.

    List parameters: PostgreSQL gets `= ANY(array)` / `<> ALL(array)` (one statement text, one server-side
    prepared plan for any list length), SQLite `IN (SELECT value FROM json_each(json))`. JSON result
    columns are decoded on SQLite (psycopg decodes them itself). Literal values the statement carries
    (`status = 'READY'`, an INSERT's unset columns) are bound from the compiled defaults.
    """

    def __init__(self, stmt: Any, dialect: Dialect) -> None:
        sqlite = dialect.name == "sqlite"
        if sqlite:  # named parameters (sqlite3 takes a dict for :name), not the engine's qmark style
            dialect = type(dialect)(paramstyle="named")  # type: ignore[call-arg]
        compiled = stmt.compile(dialect=dialect)
        self.lists = tuple(name for name, bind in compiled.binds.items() if bind.expanding)
        self.sqlite = sqlite
        self.stmt = stmt  # the SQLAlchemy statement (tests compare the two executions)

        def expand(m: re.Match[str]) -> str:
            neg, name = m.group(1), m.group(2)
            if sqlite:
                return f"{neg or ''}IN (SELECT value FROM json_each(:{name}))"
            return f"{'<> ALL' if neg else '= ANY'}(%({name})s)"

        self.sql = _EXPANDING.sub(expand, compiled.string)
        if "POSTCOMPILE" in self.sql:
            raise ValueError(f"an expanding parameter left in {self.sql!r}")
        # literal values (a bound `'READY'`) and an INSERT's unset columns (None)
        self.defaults = {n: b.effective_value for b, n in compiled.bind_names.items() if not b.expanding}
        cols = list(getattr(stmt, "selected_columns", None) or getattr(stmt, "_returning", ()) or ())
        self.row = namedtuple("Row", [c.key for c in cols]) if cols else None
        self.json = tuple(i for i, c in enumerate(cols) if isinstance(c.type, JSON)) if sqlite else ()

    def cursor(self, conn: Connection, params: Mapping[str, Any]) -> Any:
        """Execute in `conn`'s transaction; the driver's cursor (rowcount, fetch*)."""
        values = {**self.defaults, **params}
        for name in self.lists:
            seq = list(values[name])
            values[name] = orjson.dumps(seq).decode() if self.sqlite else seq
        dbapi = conn.connection.dbapi_connection
        assert dbapi is not None
        return dbapi.execute(self.sql, values)

    def rows(self, conn: Connection, params: Mapping[str, Any]) -> list[Any]:
        """Every result row, as named tuples."""
        raw = self.cursor(conn, params).fetchall()
        make = self.row._make  # type: ignore[union-attr]
        if not self.json:
            return [make(r) for r in raw]
        out = []
        for r in raw:
            r = list(r)
            for i in self.json:
                r[i] = orjson.loads(r[i]) if r[i] is not None else None
            out.append(make(r))
        return out

    def first(self, conn: Connection, params: Mapping[str, Any]) -> Any:
        """The first result row or None."""
        rows = self.rows(conn, params)
        return rows[0] if rows else None

    def run(self, conn: Connection, params: Mapping[str, Any]) -> int:
        """Execute a statement without rows; its rowcount."""
        return int(self.cursor(conn, params).rowcount)


def _serves(*, excluding: bool, sqlite: bool, accused: bool = False) -> list[Any]:
    """Conditions of a seed that may serve (b_key, b_rank): READY, fresh, unquarantined, not re-verifying,
    not accused (`accused`: only accused ones, for a probation pull; see planner.service.reports).

    On SQLite `status = 'READY'` is wrapped in likely(): without statistics SQLite walked
    ix_instances_status_updated (every READY instance of every identity: 10,000 rows per assignment at
    10,000 instances) instead of the identity's index; likely() tells its planner the term is not
    selective, and changes nothing else.
    """
    ready = Instance.status == "READY"
    conds = [
        Instance.identity_key == bindparam("b_key"),
        func.likely(ready, type_=Boolean) if sqlite else ready,
        Instance.last_heartbeat >= bindparam("b_oldest_beat"),
        or_(Instance.quarantined_until.is_(None), Instance.quarantined_until <= bindparam("b_now")),
        Instance.reverify_since.is_(None),
        Instance.integrity_failed.is_(False),
        Instance.accused_since.is_not(None) if accused else Instance.accused_since.is_(None),
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


def _anchored_seeds(active: Any) -> Any:
    """The seed rows a candidate query reads (`active`: its live-lease count), joined to the rank, its
    manifest and the identity's anchor: only manifests matching the anchored digest set are served."""
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
        .join(
            Anchor,
            and_(
                Anchor.identity_key == Instance.identity_key,
                Anchor.rank == bindparam("b_rank"),
                Anchor.checksum_algorithm == Manifest.checksum_algorithm,
                Anchor.digest_set == Manifest.digest_set,
            ),
        )
    )


def _accused(*, sqlite: bool) -> Any:
    """Accused seeds of (b_key, b_rank) that may take a probation pull (planner.service.reports), their
    manifests matching the anchor; at most b_limit rows. Read on every assignment, so it reads the
    (identity, accused_since) index and no leases: the caller counts the few rows' live pulls."""
    return (
        _anchored_seeds(literal(0))
        .where(*_serves(excluding=True, sqlite=sqlite, accused=True))
        .order_by(Instance.accused_since, Instance.id)
        .limit(bindparam("b_limit"))
    )


def _candidates(*, excluding: bool, tiered: bool, sqlite: bool) -> Any:
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
        _anchored_seeds(active)
        .outerjoin(live, live.c.instance_id == Instance.id)
        .where(*_serves(excluding=excluding, sqlite=sqlite))
        .order_by(*order, Instance.id)
        .limit(bindparam("b_limit"))
    )


def _live_starts(*, sqlite: bool) -> Any:
    """The starts of the live leases of (b_key, b_rank) on seeds that may serve it, ascending: what the
    429's estimate replays. One read of one column: counting and then reading chosen starts by OFFSET
    took several scans of the same rows per 429 (68% of a 10,000-instance simulation's time)."""
    return (
        select(Lease.created_at)
        .select_from(Lease)
        .join(Instance, Instance.id == Lease.instance_id)
        .where(
            Lease.identity_key == bindparam("b_key"),
            Lease.rank == bindparam("b_rank"),
            Lease.ended_at.is_(None),
            Lease.expires_at > bindparam("b_now"),
            *_serves(excluding=False, sqlite=sqlite),
        )
        .order_by(Lease.created_at)
    )


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
    """The statements of assign, report and the heartbeat flush (RawStatement), and the 429 estimate's
    reads (SQLAlchemy statements, run in a read session)."""

    candidates: RawStatement
    candidates_excluding: RawStatement
    ranked: RawStatement
    ranked_excluding: RawStatement
    accused: RawStatement
    lock_chosen: RawStatement
    in_rack: RawStatement
    live_leases: RawStatement
    live_starts: RawStatement
    recent_pulls: Any
    recent_pulls_any: Any
    insert_lease: RawStatement
    chosen_details: RawStatement
    lease_seed: RawStatement
    lock_seed: RawStatement
    live_lease: RawStatement
    end_lease: RawStatement
    seed_succeeded: RawStatement
    seed_accused: RawStatement
    heartbeats: RawStatement

    @classmethod
    def build(cls, dialect: Dialect) -> HotStatements:
        """The statements for SQLite (writes are serialised) or PostgreSQL (row locks: FOR UPDATE)."""
        lock = dialect.name != "sqlite"

        def raw(stmt: Any) -> RawStatement:
            return RawStatement(stmt, dialect)

        live_lease = select(
            Lease.instance_id,
            Lease.holder,
            Lease.requester_id,
            Lease.created_at,
            Lease.outcome,
            Lease.ended_at,
            Lease.expires_at,
            Lease.provider,
        ).where(Lease.id == bindparam("b_lease"))
        return cls(
            candidates=raw(_candidates(excluding=False, tiered=False, sqlite=not lock)),
            candidates_excluding=raw(_candidates(excluding=True, tiered=False, sqlite=not lock)),
            ranked=raw(_candidates(excluding=False, tiered=True, sqlite=not lock)),
            ranked_excluding=raw(_candidates(excluding=True, tiered=True, sqlite=not lock)),
            # accused seeds of (b_key, b_rank) that re-hashed clean: candidates for a probation pull
            accused=raw(_accused(sqlite=not lock)),
            # the seeds of (b_key, b_rank) in the requester's rack (b_req_rack), free ones first: rack_hold
            in_rack=raw(
                _candidates(excluding=True, tiered=False, sqlite=not lock).where(
                    Instance.rack == bindparam("b_req_rack")
                )
            ),
            # PostgreSQL: the chosen seeds' rows, locked in id order, still serving, while their live
            # leases are counted again and the new one inserted (SQLite serialises the whole write)
            lock_chosen=raw(
                select(Instance.id)
                .where(
                    Instance.id.in_(bindparam("b_ids", expanding=True)),
                    *_serves(excluding=False, sqlite=False),
                )
                .order_by(Instance.id)
                .with_for_update()
            ),
            # the chosen seeds' live leases, counted against their limits under those locks
            live_leases=raw(
                select(Lease.instance_id).where(
                    Lease.instance_id.in_(bindparam("b_ids", expanding=True)),
                    Lease.rank == bindparam("b_rank"),
                    Lease.ended_at.is_(None),
                    Lease.expires_at > bindparam("b_now"),
                )
            ),
            live_starts=raw(_live_starts(sqlite=not lock)),
            recent_pulls=_recent_pulls(of_identity=True),
            recent_pulls_any=_recent_pulls(of_identity=False),
            insert_lease=raw(insert(Lease)),
            # what the answer needs of the chosen few only (the ranking needs none of it)
            chosen_details=raw(
                select(
                    Instance.id,
                    Instance.control_url,
                    Instance.control_key,
                    InstanceRank.address,
                    Manifest.body,
                )
                .join(
                    InstanceRank,
                    and_(InstanceRank.instance_id == Instance.id, InstanceRank.rank == bindparam("b_rank")),
                )
                .join(
                    Manifest, and_(Manifest.instance_id == Instance.id, Manifest.rank == bindparam("b_rank"))
                )
                .where(Instance.id.in_(bindparam("b_ids", expanding=True)))
            ),
            lease_seed=raw(select(Lease.instance_id).where(Lease.id == bindparam("b_lease"))),
            lock_seed=raw(select(Instance.id).where(Instance.id == bindparam("b_seed")).with_for_update()),
            live_lease=raw(live_lease.with_for_update() if lock else live_lease),
            end_lease=raw(
                update(Lease)
                .where(Lease.id == bindparam("b_lease"))
                .values(
                    ended_at=bindparam("b_ended_at"),
                    outcome=bindparam("b_outcome"),
                    bytes=bindparam("b_bytes"),
                    seconds=bindparam("b_seconds"),
                    backend=bindparam("b_backend"),
                    reason=bindparam("b_reason"),
                    error=bindparam("b_error"),
                )
            ),
            seed_succeeded=raw(
                update(Instance)
                .where(Instance.id == bindparam("b_seed"), Instance.consecutive_failures != 0)
                .values(consecutive_failures=0)
            ),
            # read on every successful report: is the seed accused (planner.service.reports._verified_by)
            seed_accused=raw(select(Instance.accused_since).where(Instance.id == bindparam("b_seed"))),
            heartbeats=raw(
                update(Instance)
                .where(Instance.id.in_(bindparam("b_ids", expanding=True)))
                .values(last_heartbeat=bindparam("b_now"))
                .returning(Instance.id, Instance.status, Instance.reverify_since)
            ),
        )
