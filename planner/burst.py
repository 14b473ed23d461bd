"""Burst arithmetic: when a busy seed has a slot for this waiter, and whether waiting beats its fallback.

When every source of a rank is at its pull limit the planner answers 429 `all_busy` with numbers
computed here from the live leases on those seeds and the rates recorded in finished leases:

- rate: bytes / seconds summed over the last few successful pulls of this identity and rank (else of
  any identity, else the `assumed_pull_gbps` setting). A recorded pull already ran at the concurrency
  seeds really serve at, so one rate per identity is enough;
- pull time: the rank's bytes / rate; a live lease ends at its start + pull time (one already past
  that estimate is due now);
- the queue: each lease end frees its slot, and the loader holding it becomes a seed with
  `serves_after` slots of its own (what the waiting requester says it will serve, 0 for none: the
  planner then counts only the slots it knows of). Waiters take slots in the order they started
  waiting; a waiter's position is the number of earlier waiters still waiting (the `WaitingRoom`,
  per planner process; the requester says how long it has waited). Replaying the queue gives the
  time this waiter's slot opens;
- Retry-After: that slot time - now, clamped to [min, max], so a burst of waiters comes back spread
  over the slots instead of all at once;
- fallback: the requester may say how long its own fallback (disk, hub) would take. Waiting wins
  while slot time + pull time comes sooner; otherwise the 429 says `fallback` and the loader goes
  to its fallback at once.

Pure functions over plain numbers (and one small in-memory class), so the service, the simulator
and the tests share them.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BusyEstimate:
    """What a 429 tells the requester: when to ask again, how long a pull then takes, or to fall back."""

    retry_after_s: float
    expected_pull_s: float
    fallback: bool


def pull_rate_bps(recent: Iterable[tuple[int | None, float | None]], *, default_bps: float) -> float:
    """Bytes per second of one pull: total bytes / total seconds of `recent` (bytes, seconds) pairs."""
    total_bytes = 0
    total_s = 0.0
    for nbytes, seconds in recent:
        if nbytes and seconds and seconds > 0:
            total_bytes += nbytes
            total_s += seconds
    return total_bytes / total_s if total_s > 0 else default_bps


def slot_time(*, lease_ends: Sequence[float], position: int, pull_s: float, serves_after: int) -> float:
    """When the slot for the waiter at `position` (0 = next) opens, replaying the queue (see the module)."""
    if not lease_ends:
        raise ValueError("slot_time: no live lease to wait for")
    slots = [e for e in lease_ends for _ in range(1 + serves_after)]
    heapq.heapify(slots)
    for _ in range(position):
        t = heapq.heappop(slots)
        for _ in range(1 + serves_after):  # that waiter's pull frees the slot and adds its own
            heapq.heappush(slots, t + pull_s)
    return slots[0]


def estimate_busy(
    *,
    lease_starts: Sequence[float],
    rank_bytes: int,
    rate_bps: float,
    now: float,
    position: int = 0,
    serves_after: int = 0,
    fallback_s: float | None = None,
    min_s: float,
    max_s: float,
) -> BusyEstimate:
    """Retry-After for the waiter at `position`; `fallback` when waiting loses to `fallback_s`."""
    if rate_bps <= 0:
        raise ValueError(f"rate_bps: must be positive, got {rate_bps}")
    pull_s = rank_bytes / rate_bps
    if not lease_starts:  # no live lease left (it ended between the count and now): ask again at once
        return BusyEstimate(retry_after_s=min_s, expected_pull_s=pull_s, fallback=False)
    ends = [max(start + pull_s, now) for start in lease_starts]
    wait = slot_time(lease_ends=ends, position=position, pull_s=pull_s, serves_after=serves_after) - now
    fallback = fallback_s is not None and wait + pull_s >= fallback_s
    return BusyEstimate(retry_after_s=min(max(wait, min_s), max_s), expected_pull_s=pull_s, fallback=fallback)


@dataclass
class WaitingRoom:
    """Waiters told to come back later, per (identity key, rank), first come first served.

    A waiter's position is the number of waiters that started waiting before it and are still
    waiting, so one that comes back and must wait again keeps its place. A waiter leaves when its
    promised time passes (by then it has asked again or given up). In memory, per planner process:
    with several processes each sees its own waiters, so positions run short and waiters come back
    early, which costs an extra 429, never a wrong lease.
    """

    max_waiters: int = 100_000
    _promised: dict[tuple[str, int], list[tuple[float, float]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def position(self, key: tuple[str, int], now: float, since: float) -> int:
        """Waiters of `key` still waiting that started before `since` (a newcomer, `since` = now, also
        queues behind those that started at the same instant)."""
        with self._lock:
            entries = self._promised.get(key)
            if not entries:
                return 0
            while entries and entries[0][0] <= now:
                heapq.heappop(entries)
            if since >= now:
                return len(entries)
            return sum(1 for _, started in entries if started < since)

    def promise(self, key: tuple[str, int], at: float, since: float) -> None:
        """Record a waiter (waiting since `since`) told to come back at `at`."""
        with self._lock:
            entries = self._promised.setdefault(key, [])
            if len(entries) < self.max_waiters:
                heapq.heappush(entries, (at, since))
