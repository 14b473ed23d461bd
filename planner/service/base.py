"""What the planner's operations share: the state Planner holds and two helpers of its writes.

Planner (planner.service) is made of one class of operations per resource (instances, manifests,
assignments, compile caches, reports, observe); each reads the attributes declared here, which
Planner.__init__ sets.
"""

from __future__ import annotations

import time
from typing import Any

from planner.burst import WaitingRoom
from planner.db import Database
from planner.queries import HotStatements
from planner.selection import SelectionPolicy
from planner.settings import PlannerSettings


class ServiceState:
    """The attributes every resource's operations read (set by Planner.__init__): the database, the
    settings, the selection policy, the waiting room of busy answers, the hot statements and the secret
    that seals the seeds' control keys. State lives in the database; these are per process."""

    db: Database
    settings: PlannerSettings
    policy: SelectionPolicy
    waiting: WaitingRoom
    _sql: HotStatements
    _control_secret: bytes
    # seeds whose uncorroborated transport failures asked for a health probe (planner.service.probes)
    suspects: set[str]
    # whether any seed was accused when last read (planner.service.assignments._any_accused), and when
    accused_seen: bool
    accused_checked_at: float


def now_or_clock(now: float | None) -> float:
    """`now`, or the clock read now: call it with the write lock held. A time read before waiting for
    the lock could predate a lease end that the decision already saw, and the record would show a seed
    over its limit that never was."""
    return time.time() if now is None else now


def rowcount(result: Any) -> int:
    """Rows a statement changed (0 where the driver does not say)."""
    return int(getattr(result, "rowcount", 0) or 0)
