"""Reports and leases: a pull's outcome ends its lease, and only a seed's faults count against it, on
evidence (routes/assignments.py, planner.hotpath).

A report is a claim by its reporter, never proof: a checksum claim holds the accused seed out until
an independent verification (a later verified pull by another loader), and transport claims count
only when distinct reporters stand behind them or the planner's own probe agrees (probes.py).
Reporters are keyed per instance (`reporter_key`), so a disproved claim flags the loader that made
it, not every holder of a shared load token.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import Connection, func, select, update

from planner.contract import wire
from planner.contract.errors import Conflict, NotFound
from planner.models import Instance, Lease
from planner.service.base import ServiceState, now_or_clock, rowcount

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
        """End a lease with the pull's outcome; only a seed's faults count against it, and only on evidence.

        `reporter` is the caller's Principal.holder (None: admin); only the lease's holder may report.
        A lease that has ended (reported, expired, released) is refused (Conflict). Failures whose reason
        is in SEED_FAULTS count. A `checksum_mismatch` accuses the seed: it is asked to re-hash (a changed
        memory convicts itself against the anchor) and is offered only for probation pulls, one at a
        time to loaders that did not accuse it, until one verifies (`_verified_by`); its own clean
        republication never clears an accusation. `transport` failures quarantine it for quarantine_s
        only when corroborated by distinct reporters, or when the planner's probe of it fails
        (planner.service.probes). Anything else (a loader's own destination, engine or algorithm) is
        recorded, not blamed. Lock order (PostgreSQL): the seed's instance row, then the lease.
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
            self._verified_by(s, lease, now)
        elif body.reason == CHECKSUM_MISMATCH and self._flagged(s, lease):
            log.warning(
                "seed %s: checksum mismatch reported by %s ignored: %d of its claims were disproved",
                lease.instance_id,
                reporter_key(lease.holder, lease.requester_id),
                self.settings.false_report_threshold,
            )
        elif body.reason == CHECKSUM_MISMATCH:
            quarantined = True  # out of service until another loader verifies it (not for quarantine_s)
            s.execute(
                update(Instance)
                .where(Instance.id == lease.instance_id, Instance.accused_since.is_(None))
                .values(accused_since=now)
            )
            self.accused_seen = True  # this process's next assignment looks for probation at once
            # and asked to re-hash: a memory that changed convicts itself against the anchor
            s.execute(
                update(Instance)
                .where(Instance.id == lease.instance_id, Instance.reverify_since.is_(None))
                .values(reverify_since=now)
            )
            log.warning(
                "seed %s: a checksum mismatch reported by %s; only probation pulls until one verifies",
                lease.instance_id,
                reporter_key(lease.holder, lease.requester_id),
            )
        elif body.reason in SEED_FAULTS:
            quarantined = self._transport_failure(s, lease, now)
        return wire.ReportAnswer(id=lease_id, outcome=body.outcome, seed_quarantined=quarantined)

    def _transport_failure(self, s: Connection, lease: Any, now: float) -> bool:
        """Count a transport failure; quarantine the seed when failure_threshold of them in a row come
        from transport_witnesses distinct reporters, else ask for a probe (planner.service.probes) once
        the threshold is reached. True when it was quarantined."""
        fails = s.execute(
            update(Instance)
            .where(Instance.id == lease.instance_id)
            .values(consecutive_failures=Instance.consecutive_failures + 1)
            .returning(Instance.consecutive_failures)
        ).scalar()
        if fails is None or fails < self.settings.failure_threshold:
            return False
        recent = s.execute(
            select(Lease.holder, Lease.credential)
            .where(Lease.instance_id == lease.instance_id, Lease.reason == "transport")
            .order_by(Lease.ended_at.desc())
            .limit(fails)
        ).all()
        witnesses = {witness_key(r.holder, r.credential) for r in recent}
        if len(witnesses) < self.settings.transport_witnesses:
            self.suspects.add(lease.instance_id)  # the planner's own probe decides (probes.py)
            log.info(
                "seed %s: %d transport failure(s) from %d reporter(s), not corroborated; probing it",
                lease.instance_id,
                fails,
                len(witnesses),
            )
            return False
        s.execute(
            update(Instance)
            .where(Instance.id == lease.instance_id)
            .values(
                consecutive_failures=0,
                quarantined_until=now + self.settings.quarantine_s,
                quarantine_cause="reports",
            )
        )
        log.warning(
            "seed %s quarantined for %.0fs after %d failed pull(s) reported by %d reporters",
            lease.instance_id,
            self.settings.quarantine_s,
            fails,
            len(witnesses),
        )
        return True

    def _verified_by(self, s: Connection, lease: Any, now: float) -> None:
        """A successful (verified) pull of an accused seed, leased after the accusation to a loader that
        did not accuse it, is the independent verification: the standing claims are disproved (they
        count against their reporters) and the seed serves again."""
        seed = self._sql.seed_accused.first(s, {"b_seed": lease.instance_id})
        if seed is None or seed.accused_since is None or lease.created_at < seed.accused_since:
            return
        me = reporter_key(lease.holder, lease.requester_id)
        if identified(me) and me in {
            reporter_key(c.holder, c.requester_id)
            for c in standing_claims(s, lease.instance_id, seed.accused_since)
        }:
            return
        disproved = rowcount(
            s.execute(
                update(Lease)
                .where(
                    Lease.instance_id == lease.instance_id,
                    Lease.reason == CHECKSUM_MISMATCH,
                    Lease.ended_at >= seed.accused_since,
                    Lease.disproved.is_(None),
                )
                .values(disproved=True)
            )
        )
        s.execute(update(Instance).where(Instance.id == lease.instance_id).values(accused_since=None))
        log.warning(
            "integrity: seed %s verified by %s; %d checksum report(s) disproved",
            lease.instance_id,
            me,
            disproved,
        )

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

    def _flagged(self, s: Any, lease: Any) -> bool:
        """True when the reporter of `lease` had false_report_threshold or more checksum claims disproved;
        an admin, and a static token's caller that named no requester_id (`identified`), never are."""
        if lease.holder is None or not identified(reporter_key(lease.holder, lease.requester_id)):
            return False
        return self._disproved(s, reporter_key(lease.holder, lease.requester_id)) >= (
            self.settings.false_report_threshold
        )

    def _disproved(self, s: Any, reporter: str) -> int:
        holder, _, requester = reporter.partition("/")
        who = [Lease.holder == holder]
        if not holder.startswith("instance:"):
            who.append(Lease.requester_id == requester if requester else Lease.requester_id.is_(None))
        n = s.execute(select(func.count()).select_from(Lease).where(*who, Lease.disproved.is_(True))).scalar()
        return int(n or 0)

    def false_reports(self, reporter: str) -> int:
        """Checksum claims of `reporter` (a reporter_key) that an independent verification disproved."""
        with self.db.read() as s:
            return self._disproved(s, reporter)

    def out_of_service(self, now: float) -> dict[str, int]:
        """Seeds out of service by cause (the metric rfork_planner_quarantined_seeds): quarantined on
        distinct reporters' failures (`reports`) or a failed probe (`probe`), `accused` by a standing
        checksum report, refused against the anchor (`integrity`)."""
        counts = dict.fromkeys(_out_of_service_causes(), 0)
        with self.db.read() as s:
            rows = s.execute(
                select(Instance.quarantine_cause, func.count())
                .where(Instance.quarantined_until > now)
                .group_by(Instance.quarantine_cause)
            ).all()
            for cause, n in rows:
                key = cause if cause in counts else "reports"
                counts[key] += int(n)
            counts["accused"] = int(
                s.scalar(
                    select(func.count()).select_from(Instance).where(Instance.accused_since.is_not(None))
                )
                or 0
            )
            counts["integrity"] = int(
                s.scalar(
                    select(func.count()).select_from(Instance).where(Instance.integrity_failed.is_(True))
                )
                or 0
            )
        return counts

    def flagged_reporters(self) -> dict[str, int]:
        """Reporter keys whose disproved claims reached false_report_threshold, with their counts."""
        with self.db.read() as s:
            rows = s.execute(
                select(Lease.holder, Lease.requester_id, func.count())
                .where(Lease.disproved.is_(True))
                .group_by(Lease.holder, Lease.requester_id)
            ).all()
        counts: dict[str, int] = {}
        for holder, requester, n in rows:
            key = reporter_key(holder, requester)
            counts[key] = counts.get(key, 0) + int(n)
        return {
            k: n for k, n in counts.items() if identified(k) and n >= self.settings.false_report_threshold
        }


def _out_of_service_causes() -> tuple[str, ...]:
    return ("reports", "probe", "accused", "integrity")


def reporter_key(holder: str | None, requester_id: str | None) -> str:
    """Who made a claim: an instance token's instance (`instance:<id>`, bound at its registration), or
    under a static token that token and the requester_id its caller named (`token:<h>/<id>`; the token
    alone when it named none). So one loader's disproved claims flag that loader, not every holder of
    a shared load token."""
    h = holder or "admin"
    if h.startswith("instance:") or not requester_id:
        return h
    return f"{h}/{requester_id}"


def witness_key(holder: str | None, credential: str | None) -> str:
    """Who stands behind a failure report for corroboration: the credential recorded with its lease (a
    static token, or the one that registered the holding instance: the instances one credential
    registers are one witness, as are the requester_ids a token's callers name themselves), else the
    holder (an admin-registered instance, or a lease from before credentials were recorded)."""
    return credential or holder or "admin"


def identified(reporter: str) -> bool:
    """Whether `reporter` (a reporter_key) names one caller: an instance, or a static token's caller that
    named its requester_id. A bare shared token may stand for many loaders: its disproved claims flag
    nobody (each costs the seed one probation pull) and its callers may verify what one of them accused."""
    return reporter.startswith("instance:") or "/" in reporter


def standing_claims(s: Connection, seed_id: str, since: float) -> list[Any]:
    """Rows (holder, requester_id, credential) of the checksum reports against `seed_id` since `since`
    not yet disproved."""
    return list(
        s.execute(
            select(Lease.holder, Lease.requester_id, Lease.credential).where(
                Lease.instance_id == seed_id,
                Lease.reason == CHECKSUM_MISMATCH,
                Lease.ended_at >= since,
                Lease.disproved.is_(None),
            )
        ).all()
    )
