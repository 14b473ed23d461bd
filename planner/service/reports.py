"""Reports and leases: a pull's outcome ends its lease, and only a seed's faults count against it
(routes/assignments.py, planner.hotpath)."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import Connection, func, select, update

from planner.contract import wire
from planner.contract.errors import Conflict, NotFound
from planner.models import Instance, Lease
from planner.service.base import ServiceState, now_or_clock

log = logging.getLogger(__name__)

CHECKSUM_MISMATCH = "checksum_mismatch"
# report reasons that are the seed's fault (rfork.pull.planner_session sends them); any other reason
# (a loader's destination, engine, algorithm, ...) is recorded but never counts against the seed
SEED_FAULTS = frozenset({"transport", CHECKSUM_MISMATCH})


class ReportOps(ServiceState):
    """Planner's reports, renewals and the false-report count."""

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
        now = now_or_clock(now)
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
            now = now_or_clock(now)
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
