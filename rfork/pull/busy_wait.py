"""How a loader waits out 429 `all_busy`: sleep the planner's Retry-After, fall back only when told.

The planner (planner.burst) computes Retry-After from the busy seeds' live leases and the recorded
pull rates, and sets `fallback` when the requester's own estimate (`fallback_s`, sent with the
request) beats waiting for a seed. So the loader keeps waiting while a seed frees up sooner than its
disk load would take, and goes to disk at once otherwise. A small jitter spreads a burst of waiters
so they do not all come back in the same millisecond. `max_wait_s` bounds the whole wait.

`BusyWait.decide` is the decision alone (used as is by the scale-out simulator on simulated time);
`ask_with_wait` is the blocking loop the loader runs.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class BusyAnswer(Protocol):
    """What a 429 carries (planner.errors.AllBusy has these attributes)."""

    retry_after_s: float
    fallback: bool


@dataclass(frozen=True, kw_only=True)
class BusyWait:
    """The wait policy: follow Retry-After (plus up to `jitter` of it), give up after `max_wait_s`."""

    max_wait_s: float = 900.0
    jitter: float = 0.1
    min_sleep_s: float = 0.02

    def __post_init__(self) -> None:
        if self.max_wait_s < 0 or not 0 <= self.jitter <= 1 or self.min_sleep_s <= 0:
            raise ValueError(
                f"BusyWait: need max_wait_s >= 0, 0 <= jitter <= 1, min_sleep_s > 0 (got {self})"
            )

    def decide(self, answer: BusyAnswer, waited_s: float, rng: random.Random) -> float | None:
        """Seconds to sleep before asking again, or None: stop waiting and use the fallback now."""
        if getattr(answer, "fallback", False):
            return None
        base = max(float(answer.retry_after_s), self.min_sleep_s)
        sleep = base * (1.0 + self.jitter * rng.random())
        if waited_s + sleep > self.max_wait_s:
            return None
        return sleep


def fallback_seconds(nbytes: int, gbps: float | None) -> float | None:
    """A loader's estimate of its fallback load (bytes at `gbps` GB/s); None when it has no fallback."""
    if not gbps or gbps <= 0 or nbytes <= 0:
        return None
    return nbytes / (gbps * 1e9)


def ask_with_wait(
    ask: Callable[[float], T],
    *,
    policy: BusyWait,
    busy_type: type[BaseException],
    what: str,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
) -> T | None:
    """Call `ask(seconds waited so far)` until it returns; on `busy_type` (429) sleep as `policy`
    decides; None = fall back."""
    rng = rng or random.Random()
    started = clock()
    while True:
        try:
            return ask(clock() - started)
        except busy_type as exc:
            waited = clock() - started
            pause = policy.decide(exc, waited, rng)  # type: ignore[arg-type]
            if pause is None:
                log.info(
                    "%s: every seed busy after %.1f s of waiting (%s); falling back",
                    what,
                    waited,
                    "planner says the fallback is sooner" if getattr(exc, "fallback", False) else "limit",
                )
                return None
            log.info("%s: every seed busy; asking again in %.2f s", what, pause)
            sleep(pause)
