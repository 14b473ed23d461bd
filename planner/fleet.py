"""What the fleet page shows: identities, instances, the fan-out tree, recent transfers, refusals.

The tree's structure and every figure that outlives a pull come from the database (leases are the
transfer history; `Lease.requester_id` names the instance a pull became, set by the loader through
`mark_seeded`). Two things are kept in this process's memory only, bounded and expiring, because
they are seconds-old figures for a screen rather than records: the bytes done of pulls in progress
(`ProgressBoard`) and recent refusals (`RefusalLog`). With several planner processes behind one
address (`serve --workers N`) each one holds what was reported to it, so the page may show a live
edge without its bytes or miss a refusal; a table would fix that at one write per progress report.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update

from planner.contract import views, wire
from planner.contract.errors import Conflict, NotFound
from planner.contract.integrity import is_cryptographic
from planner.db import Database
from planner.models import Anchor, Instance, Lease
from planner.settings import PlannerSettings

PROGRESS_TTL_S = 120.0  # a progress figure not refreshed for this long is dropped
MAX_PROGRESS = 50_000  # pulls tracked at once; the oldest is dropped beyond it
MAX_REFUSALS = 200
TREE_WINDOW_S = 3600.0  # finished pulls younger than this still draw their edge in the tree
MAX_EDGES = 2000
RECENT_TRANSFERS = 100


# what the page needs of a lease (not its error text, up to 64 KiB a row)
LEASE_COLUMNS = (
    Lease.id,
    Lease.instance_id,
    Lease.requester_id,
    Lease.rank,
    Lease.provider,
    Lease.backend,
    Lease.created_at,
    Lease.expires_at,
    Lease.ended_at,
    Lease.outcome,
    Lease.bytes,
    Lease.seconds,
    Lease.reason,
)


@dataclass(frozen=True)
class Progress:
    """Bytes read so far of one live pull, as its loader last reported them."""

    bytes_done: int
    bytes_total: int
    at: float  # UNIX seconds of the report


class ProgressBoard:
    """Progress of live pulls by assignment id; thread-safe, bounded, entries expire."""

    def __init__(self, *, ttl_s: float = PROGRESS_TTL_S, capacity: int = MAX_PROGRESS) -> None:
        self._ttl_s = ttl_s
        self._capacity = capacity
        self._items: OrderedDict[str, Progress] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, assignment_id: str, progress: Progress) -> None:
        """Keep the latest figure for a pull (dropping the least recently reported beyond capacity)."""
        with self._lock:
            self._items[assignment_id] = progress
            self._items.move_to_end(assignment_id)
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)

    def snapshot(self, now: float) -> dict[str, Progress]:
        """Every figure younger than the time-to-live (older ones are dropped)."""
        with self._lock:
            while self._items:
                oldest = next(iter(self._items.values()))
                if oldest.at >= now - self._ttl_s:
                    break
                self._items.popitem(last=False)
            return dict(self._items)


class RefusalLog:
    """The latest refusals (no source, all busy, digest mismatch), newest last; thread-safe."""

    def __init__(self, capacity: int = MAX_REFUSALS) -> None:
        self._items: deque[views.Refusal] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def record(self, *, identity_key: str, rank: int, reason: str, detail: str, now: float) -> None:
        """Remember one refusal (the detail cut to 300 characters)."""
        item = views.Refusal(at=now, identity_key=identity_key, rank=rank, reason=reason, detail=detail[:300])
        with self._lock:
            self._items.append(item)

    def recent(self) -> list[views.Refusal]:
        """Newest first."""
        with self._lock:
            return list(reversed(self._items))


def _live_lease(db: Database, assignment_id: str, holder: str | None) -> Any:
    """The lease row, checked: it exists (NotFound), `holder` holds it (PermissionError), it is live
    (Conflict). `holder` None: an admin, who may act on any lease."""
    with db.read() as s:
        lease = s.execute(
            select(Lease.holder, Lease.ended_at, Lease.expires_at, Lease.outcome, Lease.requester_id).where(
                Lease.id == assignment_id
            )
        ).first()
    if lease is None:
        raise NotFound(f"assignment {assignment_id} not found")
    if holder is not None and lease.holder != holder:
        raise PermissionError(f"assignment {assignment_id} belongs to another requester")
    return lease


def record_progress(
    db: Database,
    board: ProgressBoard,
    assignment_id: str,
    report: wire.ProgressReport,
    *,
    holder: str | None,
    now: float,
) -> None:
    """Keep a live pull's bytes done; refused for another holder's or an ended lease."""
    if report.bytes_done > report.bytes_total:
        raise Conflict(f"bytes_done {report.bytes_done} exceeds bytes_total {report.bytes_total}")
    lease = _live_lease(db, assignment_id, holder)
    if lease.ended_at is not None or lease.expires_at <= now:
        raise Conflict(f"assignment {assignment_id} has ended ({lease.outcome or 'expired'})")
    board.record(assignment_id, Progress(report.bytes_done, report.bytes_total, now))


def mark_seeded(db: Database, assignment_id: str, instance_id: str, *, holder: str | None) -> None:
    """Record that `instance_id` now serves what a successful pull read (Lease.requester_id).

    Only the lease's holder may say so, once the pull succeeded; a lease already linked to another
    instance is a Conflict.
    """
    lease = _live_lease(db, assignment_id, holder)
    if lease.outcome != "success":
        raise Conflict(f"assignment {assignment_id} did not succeed ({lease.outcome or 'not reported'})")
    if lease.requester_id not in (None, instance_id):
        raise Conflict(f"assignment {assignment_id} is already linked to instance {lease.requester_id}")
    with db.write() as s:
        if s.get(Instance, instance_id) is None:
            raise NotFound(f"instance {instance_id} not found")
        s.execute(update(Lease).where(Lease.id == assignment_id).values(requester_id=instance_id))


def fleet_view(
    db: Database,
    settings: PlannerSettings,
    board: ProgressBoard,
    refusals: RefusalLog,
    now: float,
    flagged: dict[str, int] | None = None,
) -> views.FleetView:
    """The page's data in one read transaction (no addresses, descriptors, keys or tokens); `flagged`:
    the flagged reporters (Planner.flagged_reporters)."""
    flagged = flagged or {}
    progress = board.snapshot(now)
    with db.read() as s:
        insts = s.execute(
            select(
                Instance.id,
                Instance.identity_key,
                Instance.identity,
                Instance.status,
                Instance.node,
                Instance.rack,
                Instance.zone,
                Instance.max_concurrent_pulls,
                Instance.last_heartbeat,
                Instance.quarantined_until,
                Instance.reverify_since,
                Instance.integrity_failed,
                Instance.accused_since,
                Instance.quarantine_cause,
                Instance.created_at,
            ).order_by(Instance.created_at, Instance.id)
        ).all()
        anchors = s.execute(
            select(
                Anchor.identity_key,
                Anchor.rank,
                Anchor.checksum_algorithm,
                Anchor.digest_set,
                Anchor.instance_id,
            ).order_by(Anchor.identity_key, Anchor.rank, Anchor.checksum_algorithm)
        ).all()
        edges = s.execute(
            select(*LEASE_COLUMNS)
            .where(
                (Lease.ended_at.is_(None))
                | ((Lease.outcome == "success") & (Lease.ended_at > now - TREE_WINDOW_S))
            )
            .order_by(Lease.created_at.desc())
            .limit(MAX_EDGES)
        ).all()
        recent = s.execute(
            select(*LEASE_COLUMNS)
            .where(Lease.ended_at.is_not(None))
            .order_by(Lease.ended_at.desc(), Lease.id)
            .limit(RECENT_TRANSFERS)
        ).all()
        live_by_seed: dict[str, int] = dict(
            s.execute(
                select(Lease.instance_id, func.count())
                .where(Lease.ended_at.is_(None), Lease.expires_at > now)
                .group_by(Lease.instance_id)
            ).all()
        )
        quarantined = [i.id for i in insts if i.quarantined_until is not None and i.quarantined_until > now]
        why: dict[str, str] = {}
        cause = {i.id: i.quarantine_cause for i in insts}
        for iid in quarantined:
            if cause[iid] == "probe":
                why[iid] = "failed the planner's health probe"
                continue
            why[iid] = (
                s.scalar(
                    select(Lease.reason)
                    .where(Lease.instance_id == iid, Lease.outcome == "failure")
                    .order_by(Lease.ended_at.desc())
                    .limit(1)
                )
                or "failed pulls"
            ) + (" (reports from distinct reporters)" if cause[iid] == "reports" else "")
    for i in insts:  # out of service until it re-hashes its memory against the anchor (a checksum report)
        if i.integrity_failed:
            why[i.id] = "failed re-verification: not offered until it republishes clean"
        elif i.reverify_since is not None:
            why[i.id] = "re-verifying its memory after a checksum report"
        elif i.accused_since is not None:
            why[i.id] = "accused by a checksum report: probation pulls only, until another loader verifies it"
    edge_views = []
    for lease in edges:
        live = lease.ended_at is None and lease.expires_at > now
        if lease.ended_at is None and not live:
            continue  # expired, not yet reaped
        if live:
            p = progress.get(lease.id)
            done = p.bytes_done if p else 0
            total = p.bytes_total if p else None
            took = (p.at - lease.created_at) if p else 0.0
        else:
            done, total, took = lease.bytes or 0, lease.bytes, lease.seconds or 0.0
        edge_views.append(
            views.FleetEdge(
                assignment_id=lease.id,
                seed_id=lease.instance_id,
                loader_id=lease.requester_id,
                rank=lease.rank,
                transport=lease.backend or lease.provider,
                started_at=lease.created_at,
                live=live,
                bytes_done=done,
                bytes_total=total,
                gbps=done / took / 1e9 if done and took > 0 else None,
                outcome=lease.outcome,
            )
        )
    idents: dict[str, views.FleetIdentity] = {}
    for i in insts:
        if i.identity_key in idents:
            continue
        ident = i.identity
        idents[i.identity_key] = views.FleetIdentity(
            identity_key=i.identity_key,
            model=str(ident.get("model", "")),
            revision=str(ident.get("revision", "")),
            framework=f"{ident.get('framework', '')} {ident.get('framework_version', '')}".strip(),
            dtype=str(ident.get("dtype", "")),
            layout=" ".join(f"{k}{ident.get(k, 1)}" for k in ("tp", "pp", "ep", "dp")),
            ranks=int(ident.get("tp", 1)) * int(ident.get("pp", 1)),
            anchors=[],
        )
    for a in anchors:
        if a.identity_key in idents:
            idents[a.identity_key].anchors.append(
                views.FleetAnchor(
                    rank=a.rank,
                    checksum_algorithm=a.checksum_algorithm,
                    cryptographic=is_cryptographic(a.checksum_algorithm),
                    digest_set=a.digest_set[:12],
                    anchored_by=a.instance_id,
                )
            )
    return views.FleetView(
        now=now,
        identities=list(idents.values()),
        instances=[
            views.FleetInstance(
                id=i.id,
                identity_key=i.identity_key,
                status=wire.InstanceStatus(i.status),
                labels=wire.Labels(node=i.node, rack=i.rack, zone=i.zone),
                pulls=live_by_seed.get(i.id, 0),
                max_concurrent_pulls=i.max_concurrent_pulls,
                heartbeat_age_s=max(0.0, now - i.last_heartbeat),
                quarantined_for_s=(
                    i.quarantined_until - now
                    if i.id in quarantined and i.quarantined_until is not None
                    else None
                ),
                quarantine_reason=why.get(i.id),
                accused=i.accused_since is not None,
            )
            for i in insts
        ],
        edges=edge_views,
        transfers=[
            views.FleetTransfer(
                assignment_id=r.id,
                seed_id=r.instance_id,
                loader_id=r.requester_id,
                rank=r.rank,
                transport=r.backend or r.provider,
                ended_at=r.ended_at or now,
                seconds=r.seconds,
                bytes=r.bytes,
                gbps=(r.bytes / r.seconds / 1e9) if r.bytes and r.seconds else None,
                outcome=r.outcome or "expired",
                reason=r.reason,
            )
            for r in recent
        ],
        refusals=refusals.recent(),
        flagged_reporters=[
            views.FlaggedReporter(reporter=k, disproved=n) for k, n in sorted(flagged.items())
        ],
    )
