"""ImmCounter: counts arrivals of 32-bit immediates so `expect` never races the writes it waits for."""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future

log = logging.getLogger(__name__)

MAX_STORED = 1 << 20  # values with unconsumed arrivals kept; beyond, arrivals nobody waits for are dropped


class ImmCounter:
    """Per-value arrival counts since the engine opened; waiters consume arrivals in FIFO order.

    Thread-safe: arrivals come from progress threads, expects from any thread. Futures are resolved
    outside the lock (their callbacks may call back into the counter). Only values with arrivals
    not yet consumed are stored, at most MAX_STORED of them: a peer writing values nobody waits for
    cannot grow the table without bound (those arrivals are dropped and counted in `dropped`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[int, int] = {}
        self._waiters: dict[int, deque[tuple[int, Future[None]]]] = {}
        self.dropped = 0

    def arrive(self, imm: int, n: int = 1) -> None:
        """Record n arrivals of imm and resolve the waiters they satisfy."""
        ready: list[Future[None]] = []
        with self._lock:
            if imm not in self._counts and imm not in self._waiters and len(self._counts) >= MAX_STORED:
                self.dropped += n
                log.warning("immediate %#x dropped: %d values already wait to be consumed", imm, MAX_STORED)
                return
            have = self._counts.get(imm, 0) + n
            queue = self._waiters.get(imm)
            while queue and have >= queue[0][0]:
                need, fut = queue.popleft()
                have -= need
                ready.append(fut)
            if queue is not None and not queue:
                del self._waiters[imm]
            self._set(imm, have)
        for fut in ready:
            fut.set_result(None)

    def expect(self, imm: int, count: int) -> Future[None]:
        """A future resolved once `count` arrivals of imm are available; it consumes them."""
        if not 0 <= imm < 2**32:
            raise ValueError(f"imm {imm} is not a 32-bit unsigned value")
        if count < 0:
            raise ValueError(f"count {count} is negative")
        fut: Future[None] = Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            have = self._counts.get(imm, 0)
            done = imm not in self._waiters and have >= count
            if done:
                self._set(imm, have - count)
            else:
                self._waiters.setdefault(imm, deque()).append((count, fut))
        if done:
            fut.set_result(None)
        return fut

    def _set(self, imm: int, count: int) -> None:
        if count:
            self._counts[imm] = count
        else:
            self._counts.pop(imm, None)

    def discard(self, imm: int, fut: Future[None]) -> bool:
        """Withdraw a waiter that is no longer wanted (its request failed); True if it was waiting."""
        with self._lock:
            queue = self._waiters.get(imm)
            if not queue:
                return False
            for i, (_need, f) in enumerate(queue):
                if f is fut:
                    del queue[i]
                    if not queue:
                        del self._waiters[imm]
                    return True
        return False

    def pending(self, imm: int) -> int:
        """Arrivals of imm not yet consumed by an expect."""
        with self._lock:
            return self._counts.get(imm, 0)

    def forget(self, base: int, count: int, exc: BaseException) -> None:
        """Drop the counts of values [base, base + count) and fail their waiters (a channel closed)."""
        with self._lock:
            if count <= len(self._counts):
                for imm in range(base, base + count):
                    self._counts.pop(imm, None)
            else:
                for imm in [v for v in self._counts if base <= v < base + count]:
                    del self._counts[imm]
            if count <= len(self._waiters):
                gone = [v for v in range(base, base + count) if v in self._waiters]
            else:
                gone = [v for v in self._waiters if base <= v < base + count]
            futs = [f for v in gone for _, f in self._waiters.pop(v)]
        for fut in futs:
            fut.set_exception(exc)

    def fail_all(self, exc: BaseException) -> None:
        """Fail every outstanding expect (engine closing)."""
        with self._lock:
            futs = [f for q in self._waiters.values() for _, f in q]
            self._waiters.clear()
        for fut in futs:
            fut.set_exception(exc)
