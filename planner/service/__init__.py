"""The planner's operations on the database, one module per resource (mirroring planner/routes/).

`Planner` is the facade the routes, planner.hotpath, the simulator and tests call: it holds the state
(planner.service.base) and is made of the resources' operations: instances, manifests (and anchors),
assignments (and their 429s, busy), compile caches, reports (and leases), probes and observe; the reaper is
a function (planner.service.reaper). Methods take `now` (UNIX seconds) so tests can move time; routes
pass time.time().
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection

from planner.burst import WaitingRoom
from planner.contract.errors import PlannerError
from planner.db import Database
from planner.queries import HotStatements
from planner.selection import SelectionPolicy, make_policy
from planner.service.assignments import AssignmentOps
from planner.service.compile_caches import CompileCacheOps
from planner.service.instances import InstanceOps
from planner.service.manifests import ManifestOps
from planner.service.observe import ObserveOps
from planner.service.probes import ProbeOps
from planner.service.reports import ReportOps
from planner.settings import PlannerSettings

T = TypeVar("T")


class Planner(InstanceOps, ManifestOps, AssignmentOps, CompileCacheOps, ReportOps, ObserveOps, ProbeOps):
    """The service behind the routes: one per app, thread-safe (state lives in the database).

    Embedding it without HTTP (the simulator, tests): `Planner.open(settings)` on a migrated
    database (planner.db.migrate), then `close()`. Methods take `now` (UNIX seconds) and return
    planner.contract types; errors are planner.contract.errors (NotFound, Conflict, NoSource, AllBusy,
    ...).
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
        # lease id -> requester (node, rack) if its loader will serve, else None (planner.service.busy)
        self._serving: dict[str, tuple[str, str] | None] = {}
        self._sql = HotStatements.build(db.engine.dialect)
        self._control_secret = settings.control_secret_bytes()
        self.suspects = set()
        self.accused_seen, self.accused_checked_at = True, float("-inf")

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


def _step(step: Callable[[Connection], Callable[[], T]], s: Connection) -> Callable[[], T] | Exception:
    try:
        return step(s)
    except (PlannerError, PermissionError) as exc:
        return exc
