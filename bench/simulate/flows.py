"""A flow-level network model: transfers share link capacities max-min fairly (water-filling).

Each flow crosses a few resources (a node's NIC egress, the receiver's NIC ingress, a rack uplink,
the hub's egress, a local disk); each resource has a capacity in bytes/s. Rates are recomputed
whenever a flow starts or ends, which is exact for a fluid model: between two such events every
flow runs at a constant rate.

Flows live in numpy arrays and time is applied lazily (only when rates change or bytes are read),
and the next completion is cached while rates hold: a 10,000-instance burst has thousands of flows
and tens of thousands of events, and a per-event pass over every flow in Python took most of the
simulator's time.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

Resource = Hashable


@dataclass(frozen=True)
class Flow:
    """One transfer as of now: bytes left, the resources it crosses and its rate (bytes/s)."""

    key: Hashable
    remaining: float
    resources: tuple[Resource, ...]
    rate: float = 0.0


@dataclass
class Network:
    """Capacities per resource (fixed once a flow uses the resource) and the flows in progress."""

    capacity: dict[Resource, float] = field(default_factory=dict)
    _keys: list[Hashable] = field(default_factory=list)  # flow i's key
    _index: dict[Hashable, int] = field(default_factory=dict)
    _res: list[tuple[int, ...]] = field(default_factory=list)  # flow i's resource numbers
    _rem: np.ndarray = field(default_factory=lambda: np.zeros(0))
    _rate: np.ndarray = field(default_factory=lambda: np.zeros(0))
    _rid: dict[Resource, int] = field(default_factory=dict)
    _rnames: list[Resource] = field(default_factory=list)
    _cap: np.ndarray = field(default_factory=lambda: np.zeros(0))
    _lag: float = 0.0  # seconds advanced but not yet applied to _rem
    _clock: float = 0.0
    _next: tuple[float, Hashable] | None = None  # (absolute time, key) while rates hold
    _dirty: bool = False

    def __len__(self) -> int:
        return len(self._keys)

    def start(self, key: Hashable, nbytes: float, resources: Sequence[Resource]) -> None:
        """A new flow of `nbytes` over `resources` (each must have a capacity)."""
        if not resources:
            raise ValueError(f"flow {key!r}: crosses no resource")
        for r in resources:
            if self.capacity.get(r, 0) <= 0:
                raise ValueError(f"flow {key!r}: resource {r!r} has no capacity")
        if key in self._index:
            raise ValueError(f"flow {key!r} is already running")
        self._sync()
        ids = []
        for r in resources:
            if r not in self._rid:
                self._rid[r] = len(self._rnames)
                self._rnames.append(r)
                self._cap = np.append(self._cap, float(self.capacity[r]))
            ids.append(self._rid[r])
        self._index[key] = len(self._keys)
        self._keys.append(key)
        self._res.append(tuple(ids))
        self._rem = np.append(self._rem, float(nbytes))
        self._rate = np.append(self._rate, 0.0)
        self._dirty = True

    def advance(self, dt: float) -> None:
        """Move every flow on by `dt` seconds at its current rate."""
        if dt <= 0:
            return
        self._rates()
        self._lag += dt
        self._clock += dt

    def next_completion(self) -> tuple[float, Hashable] | None:
        """(seconds until the next flow finishes, its key), or None without flows."""
        if not self._keys:
            return None
        self._rates()
        if self._next is None:
            with np.errstate(divide="ignore"):
                left = np.where(self._rate > 0, self._rem / self._rate, np.inf)
            i = int(np.argmin(left))
            self._next = (self._clock - self._lag + float(left[i]), self._keys[i])
        return max(0.0, self._next[0] - self._clock), self._next[1]

    def finished(self, threshold: float = 1.0) -> list[Hashable]:
        """Keys of the flows with at most `threshold` bytes left."""
        self._sync()
        return [self._keys[i] for i in np.flatnonzero(self._rem <= threshold)]

    def finish(self, key: Hashable) -> None:
        """Remove a finished flow (the last one takes its place in the arrays)."""
        self._sync()
        i = self._index.pop(key)
        last = len(self._keys) - 1
        if i != last:
            moved = self._keys[last]
            self._keys[i], self._res[i] = moved, self._res[last]
            self._rem[i], self._rate[i] = self._rem[last], self._rate[last]
            self._index[moved] = i
        self._keys.pop()
        self._res.pop()
        self._rem, self._rate = self._rem[:last], self._rate[:last]
        self._dirty = True

    @property
    def flows(self) -> dict[Hashable, Flow]:
        """The flows as of now (a snapshot, for inspection)."""
        self._sync()
        return {
            k: Flow(
                key=k,
                remaining=float(self._rem[i]),
                resources=tuple(self._rnames[r] for r in self._res[i]),
                rate=float(self._rate[i]),
            )
            for i, k in enumerate(self._keys)
        }

    def _sync(self) -> None:
        """Apply the time advanced since the rates were last applied."""
        if self._lag:
            np.maximum(self._rem - self._rate * self._lag, 0.0, out=self._rem)
            self._lag = 0.0

    def _rates(self) -> None:
        """Max-min fair rates: repeatedly saturate the resource with the smallest fair share."""
        if not self._dirty:
            return
        self._sync()
        self._dirty = False
        self._next = None
        nflows = len(self._keys)
        if not nflows:
            return
        nres = len(self._rnames)
        lens = np.fromiter((len(r) for r in self._res), dtype=np.intp, count=nflows)
        res = np.fromiter(itertools.chain.from_iterable(self._res), dtype=np.intp, count=int(lens.sum()))
        owner = np.repeat(np.arange(nflows), lens)
        left = self._cap.copy()
        count = np.bincount(res, minlength=nres).astype(np.float64)
        rate = np.zeros(nflows)
        frozen = np.zeros(nflows, dtype=bool)
        while not frozen.all():
            used = count > 0
            share_of = np.full(nres, np.inf)
            share_of[used] = left[used] / count[used]
            share = float(share_of.min())
            tight = share_of <= share * (1 + 1e-12)
            # every unfrozen flow on a tight resource gets the share
            new = np.zeros(nflows, dtype=bool)
            new[owner[tight[res] & ~frozen[owner]]] = True
            rate[new] = share
            frozen |= new
            on_new = new[owner]
            taken = np.bincount(res[on_new], minlength=nres)
            left -= taken * share
            count -= taken
        self._rate = rate
