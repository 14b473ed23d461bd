"""Waiting for an event in a test: poll a condition until it holds, within a bound.

A fixed sleep that stands for an event ("the server is up", "the message arrived") is either
too long (the suite waits for nothing) or too short on a busy box (the test flakes). Poll the event
instead: `wait_until` returns as soon as it holds, and fails the test, naming it, when it never does.
The bound is a limit for a shared 2-core box, not a timing assertion.

No project imports: tests/planner and tests/backends use it too (tests/test_house.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T], timeout_s: float, what: str | Callable[[], str], *, every_s: float = 0.02
) -> T:
    """Call `predicate` until it returns something truthy, and return that; AssertionError naming `what`
    (and the last value seen) when `timeout_s` passes first. `what` may be a callable, called then, for
    a message that says how far it got. `every_s`: the pause between calls."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() >= deadline:
            said = what if isinstance(what, str) else what()
            raise AssertionError(f"not within {timeout_s:g} s: {said} (last: {got!r})")
        time.sleep(every_s)


def holds_for(predicate: Callable[[], object], for_s: float, what: str, *, every_s: float = 0.02) -> None:
    """A negative check: `predicate` stays truthy for `for_s` seconds ("nothing arrives meanwhile").

    Nothing marks the end of a non-event, so this one waits out a fixed window: keep it short, and say
    at the call what could happen within it. It fails as soon as the predicate turns false."""
    deadline = time.monotonic() + for_s
    while True:
        if not predicate():
            raise AssertionError(f"no longer true within {for_s:g} s: {what}")
        if time.monotonic() >= deadline:
            return
        time.sleep(every_s)
