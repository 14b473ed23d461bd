"""Burst arithmetic: when a busy seed has a slot for this waiter, and whether waiting beats its fallback.

When every source of a rank is at its pull limit the planner answers 429 `all_busy` with numbers
computed here from the live leases on those seeds and the rates recorded in finished leases:

- rate: bytes / seconds summed over the last few successful pulls of this identity and rank (else of
  any identity, else the `assumed_pull_gbps` setting). A recorded pull already ran at the concurrency
  seeds really serve at, so one rate per identity is enough;
- pull time: the rank's bytes / rate; a live lease ends at its start + pull time (one already past
  that estimate is due now: a grace before it left freed slots idle, 2.3-4.7x the ideal tree at 2,000);
- the queue: each lease end frees its slot, and the loader holding it becomes a seed with
  `serves_after` slots of its own (what the waiting requester says it will serve, 0 for none: the
  planner then counts only the slots it knows of). Waiters take slots in the order they started
  waiting, ties (waiters that started at the same instant, e.g. a whole fleet started at once) in
  the order they were first told to wait (the requester: its id, else its node); a waiter's
  position is the number of earlier waiters still waiting (the `WaitingRoom`, per planner process;
  the requester says how long it has waited). Replaying the queue gives the
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

import bisect
import heapq
import itertools
import math
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


def slot_index(*, leases: int, position: int, serves_after: int) -> tuple[int, int]:
    """(i, g): the waiter at `position` gets the slot of the i-th earliest lease end (0-based), g pulls
    after it, when every lease ends within one pull of the first (live leases always do).

    Generation g of slots opens at each end + g pulls, (1 + serves_after) ** (g + 1) slots per end; the
    generations never interleave. Needs only the number of leases, so the caller reads one lease's
    start, not all of them.
    """
    if leases < 1:
        raise ValueError("slot_index: no live lease to wait for")
    fan = 1 + serves_after
    if fan == 1:
        generation, k = divmod(position, leases)
        return k, generation
    k, generation, each = position, 0, fan
    while k >= each * leases:
        k -= each * leases
        generation += 1
        each *= fan
    return k // each, generation


def slot_time(*, lease_ends: Sequence[float], position: int, pull_s: float, serves_after: int) -> float:
    """When the slot for the waiter at `position` (0 = next) opens, replaying the queue (see the module).

    The replay pops slots one by one; here slots are counted in groups (a time and how many open then),
    and when every lease ends within one pull of the first (always so for live leases) whole
    generations at once: waiter k's slot follows in O(log k) steps, or O(k / leases) without new seeds
    at most, whatever `serves_after` is. Bounded for the waiting room's 100,000 waiters.
    """
    if not lease_ends:
        raise ValueError("slot_time: no live lease to wait for")
    if position < 0 or serves_after < 0 or pull_s < 0:
        raise ValueError("slot_time: position, serves_after and pull_s must not be negative")
    ends = sorted(lease_ends)
    fan = 1 + serves_after
    if ends[-1] - ends[0] <= pull_s:
        index, generation = slot_index(leases=len(ends), position=position, serves_after=serves_after)
        return ends[index] + generation * pull_s
    groups: list[tuple[float, int]] = []  # (time, slots opening then), merged by time
    counts: dict[float, int] = {}
    for e in ends:
        counts[e] = counts.get(e, 0) + fan
    groups = list(counts.items())
    heapq.heapify(groups)
    k = position
    while True:
        t, n = heapq.heappop(groups)
        while groups and groups[0][0] == t:
            n += heapq.heappop(groups)[1]
        if k < n:
            return t
        k -= n
        heapq.heappush(groups, (t + pull_s, n * fan))


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
    """Retry-After for the waiter at `position`; `fallback` when waiting loses to `fallback_s`.

    `lease_starts`: the live leases' start times, ascending. Only its length and three items are read
    when no start lies ahead of `now` (then every end lies within one pull of now: `slot_index`), so it
    may be a lazy sequence (the service reads every start in one query: cheaper than a COUNT and
    OFFSET reads of the same rows).
    """
    if rate_bps <= 0:
        raise ValueError(f"rate_bps: must be positive, got {rate_bps}")
    pull_s = rank_bytes / rate_bps
    if not lease_starts:  # no live lease left (it ended between the count and now): ask again at once
        return BusyEstimate(retry_after_s=min_s, expected_pull_s=pull_s, fallback=False)
    # a lease ends at its start + one pull, or now when that is past; ends follow the starts' order
    leases = len(lease_starts)
    first, last = (max(lease_starts[i] + pull_s, now) for i in (0, leases - 1))
    if last - first <= pull_s:  # always, unless a start lies ahead of now (another process's clock)
        index, generation = slot_index(leases=leases, position=position, serves_after=serves_after)
        slot = max(lease_starts[index] + pull_s, now) + generation * pull_s
    else:
        ends = [max(start + pull_s, now) for start in lease_starts]
        slot = slot_time(lease_ends=ends, position=position, pull_s=pull_s, serves_after=serves_after)
    wait = slot - now
    fallback = fallback_s is not None and wait + pull_s >= fallback_s
    return BusyEstimate(retry_after_s=min(max(wait, min_s), max_s), expected_pull_s=pull_s, fallback=fallback)


# A returning waiter says how long it has waited; the planner subtracts that from its own clock, so the
# `since` it computes drifts from the first one by the round trip and the two clocks' steps. A waiter
# (key, tie) whose `since` lies within this many seconds of a held place is that place's owner.
SINCE_SLACK_S = 1.0


@dataclass
class WaitingRoom:
    """Waiters told to come back later, per (identity key, rank), first come first served.

    A waiter's position is the number of waiters that started waiting before it and are still
    waiting, so one that comes back and must wait again keeps its place. It is recognised by its
    `tie` (the requester's id or node) and a `since` within SINCE_SLACK_S of the one it first gave
    (an anonymous waiter, tie "", by its exact `since`):
    a real loader's `since` (planner clock - its own waited_s) is never the same float twice, and
    matching it exactly made every re-ask a newcomer queued behind its own earlier place, so that
    positions grew with each ask and waiters slept through seeds that had become free (measured on
    the emulated fleet, docs/scale-out.md). Waiters that started at the same instant (a fleet started
    at once) keep the order in which they were first told to wait, so the k-th of them is told the
    k-th slot, not the first.
    A waiter leaves when its
    promised time passes (by then it has asked again or given up). In memory, per planner process:
    with several processes each sees its own waiters, so positions run short and waiters come back
    early, which costs an extra 429, never a wrong lease. Bounded: at most `max_waiters` over all keys
    (a full room forgets the newcomer, who then queues as if first: again an early 429 at worst); a
    position is a binary search in the sorted (start, first promise) pairs, so 100,000 waiters asking cost
    O(log n) each plus the removal of those whose time passed.
    """

    max_waiters: int = 100_000
    # a waiter is (key, since, tie); its entry (since, n) orders it, n its first promise's number
    _expiries: list[tuple[float, tuple[str, int], tuple[float, int]]] = field(default_factory=list)
    _starts: dict[tuple[str, int], list[tuple[float, int]]] = field(default_factory=dict)  # sorted
    _until: dict[tuple[tuple[str, int], tuple[float, int]], tuple[float, str]] = field(default_factory=dict)
    # (key, tie) -> that requester's places, sorted (one, unless ties are shared, e.g. empty)
    _entries: dict[tuple[tuple[str, int], str], list[tuple[float, int]]] = field(default_factory=dict)
    _count: itertools.count[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def size(self) -> int:
        """Waiters held now, over every key."""
        with self._lock:
            return len(self._until)

    def position(self, key: tuple[str, int], now: float, since: float, tie: str = "") -> int:
        """Waiters of `key` still waiting that started before `since`, or at `since` and were first told
        to wait before this one (a newcomer queues behind every waiter that started when it did)."""
        with self._lock:
            self._expire(now)
            starts = self._starts.get(key)
            if not starts:
                return 0
            if since >= now:
                return len(starts)
            entry = self._find(key, since, tie) or (since, math.inf)
            return bisect.bisect_left(starts, entry)

    def promise(
        self, key: tuple[str, int], at: float, since: float, now: float | None = None, tie: str = ""
    ) -> None:
        """Record a waiter (waiting since `since`, told apart from others with that start by `tie`) told
        to come back at `at`. It stays as long again after `at` (a loader's jitter), so that waiters told
        the same time and coming back one by one still see each other; asking again keeps its place."""
        with self._lock:
            if now is not None:
                self._expire(now)
            until = at + (at - now if now is not None else 0.0)
            entry = self._find(key, since, tie)
            if entry is None:
                if len(self._until) >= self.max_waiters:
                    return
                entry = (since, next(self._count))
                bisect.insort(self._entries.setdefault((key, tie), []), entry)
                bisect.insort(self._starts.setdefault(key, []), entry)
            self._until[(key, entry)] = (until, tie)
            heapq.heappush(self._expiries, (until, key, entry))

    def leave(self, key: tuple[str, int], since: float, tie: str = "") -> None:
        """The waiter got its slot: it no longer holds a place."""
        with self._lock:
            entry = self._find(key, since, tie)
            if entry is not None:
                self._remove(key, entry)

    def _find(self, key: tuple[str, int], since: float, tie: str) -> tuple[float, int] | None:
        """The place of the waiter (key, tie) whose first `since` is nearest `since`, within
        SINCE_SLACK_S (exactly `since` for an anonymous waiter, tie ""); None for a newcomer (lock held)."""
        mine = self._entries.get((key, tie))
        if not mine:
            return None
        slack = SINCE_SLACK_S if tie else 0.0
        i = bisect.bisect_left(mine, (since - slack, -1))
        best: tuple[float, int] | None = None
        while i < len(mine) and mine[i][0] <= since + slack:
            if best is None or abs(mine[i][0] - since) < abs(best[0] - since):
                best = mine[i]
            i += 1
        return best

    def _expire(self, now: float) -> None:
        """Forget the waiters whose time has passed, of every key (lock held)."""
        entries = self._expiries
        while entries and entries[0][0] <= now:
            until, key, entry = heapq.heappop(entries)
            held = self._until.get((key, entry))
            if held is not None and held[0] == until:  # else replaced by a later promise, or left
                self._remove(key, entry)

    def _remove(self, key: tuple[str, int], entry: tuple[float, int]) -> None:
        _, tie = self._until.pop((key, entry))
        mine = self._entries[(key, tie)]
        del mine[bisect.bisect_left(mine, entry)]
        if not mine:
            del self._entries[(key, tie)]
        starts = self._starts[key]
        del starts[bisect.bisect_left(starts, entry)]
        if not starts:
            del self._starts[key]
