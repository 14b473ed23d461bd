"""The planner's own health probe of a seed: what a quarantine rests on when reports alone do not.

A transport report is a loader's claim; one token's claims alone never quarantine a seed
(planner.service.reports). When they reach failure_threshold without corroboration, the planner asks
the seed itself: `GET {control_url}/v1/health` through planner.contract.seed_http (a whole answer within
probe_timeout_s, a small body cap). A failed probe quarantines it for quarantine_s; a later successful
probe of a quarantined seed (every probe_interval_s) clears the quarantine, whatever set it. A seed with
no control endpoint cannot be probed: only corroborated reports quarantine it, for quarantine_s. Nor can
one whose control URL resolves outside `probe_networks` (RFORK_PROBE_NETWORKS, when set): the planner
connects to no other address, so a register token cannot use the probe's outcome to learn which
host:port the planner reaches answers.
"""

from __future__ import annotations

import functools
import logging
from urllib.parse import urlsplit

from sqlalchemy import select, update

from planner.contract import seed_http
from planner.contract.networks import Network, NetworkRefused, parse_networks, resolve_within
from planner.models import Instance
from planner.service.base import ServiceState

log = logging.getLogger(__name__)

PROBE_BATCH = 64  # quarantined seeds probed per pass


PROBE_NETWORKS_ENV = "RFORK_PROBE_NETWORKS"


def seed_is_healthy(control_url: str, timeout_s: float, networks: list[Network] | None = None) -> bool | None:
    """Whether the seed's control endpoint answers 200 to GET /v1/health within `timeout_s` in all; None
    (not probed, nothing connected) when its host resolves only outside `networks`."""
    resolve = functools.partial(resolve_within, networks=networks, what=PROBE_NETWORKS_ENV)
    try:
        answer = seed_http.exchange(
            control_url.rstrip("/") + "/v1/health", deadline_s=timeout_s, max_body_bytes=16 << 10,
            resolve=resolve,
        )
    except NetworkRefused as exc:
        log.warning("probe of %s not made: %s", urlsplit(control_url).netloc, exc)
        return None
    except OSError as exc:  # SeedHttpError, or the host does not resolve
        log.info("probe of %s failed: %s", control_url, exc)
        return False
    return answer.status == 200


class ProbeOps(ServiceState):
    """Planner's health probes of seeds (run by the app's prober task, in a worker thread)."""

    def probe_seed(self, instance_id: str, now: float) -> bool | None:
        """Probe one seed and act on it: failed -> quarantined for quarantine_s (cause "probe"); healthy ->
        its quarantine and failure count cleared. None when it is gone or has no control endpoint."""
        with self.db.read() as s:
            url = s.scalar(select(Instance.control_url).where(Instance.id == instance_id))
        if not url:
            return None
        networks = parse_networks(self.settings.probe_networks)
        healthy = seed_is_healthy(url, self.settings.probe_timeout_s, networks)
        if healthy is None:
            return None
        with self.db.write() as s:
            if healthy:
                s.execute(
                    update(Instance)
                    .where(Instance.id == instance_id)
                    .values(consecutive_failures=0, quarantined_until=None, quarantine_cause=None)
                )
            else:
                s.execute(
                    update(Instance)
                    .where(Instance.id == instance_id)
                    .values(
                        consecutive_failures=0,
                        quarantined_until=now + self.settings.quarantine_s,
                        quarantine_cause="probe",
                    )
                )
        if healthy:
            log.info("probe: seed %s is healthy; not quarantined", instance_id)
        else:
            log.warning(
                "probe: seed %s failed its health probe; quarantined for %.0fs",
                instance_id,
                self.settings.quarantine_s,
            )
        return healthy

    def probe_pass(self, now: float, *, quarantined: bool = True) -> int:
        """Probe the seeds reports asked about, then (`quarantined`) up to PROBE_BATCH quarantined ones;
        how many were probed."""
        asked = list(self.suspects)
        self.suspects.difference_update(asked)
        if not quarantined:
            for iid in asked:
                self.probe_seed(iid, now)
            return len(asked)
        with self.db.read() as s:
            held = list(
                s.scalars(
                    select(Instance.id)
                    .where(Instance.quarantined_until > now, Instance.control_url.is_not(None))
                    .order_by(Instance.quarantined_until)
                    .limit(PROBE_BATCH)
                ).all()
            )
        ids = list(dict.fromkeys(asked + held))
        for iid in ids:
            self.probe_seed(iid, now)
        return len(ids)
