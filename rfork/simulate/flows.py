"""A flow-level network model: transfers share link capacities max-min fairly (water-filling).

Each flow crosses a few resources (a node's NIC egress, the receiver's NIC ingress, a rack uplink,
the hub's egress, a local disk); each resource has a capacity in bytes/s. Rates are recomputed
whenever a flow starts or ends, which is exact for a fluid model: between two such events every
flow runs at a constant rate.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

Resource = Hashable


@dataclass
class Flow:
    """One transfer: bytes left, the resources it crosses and its current rate (bytes/s)."""

    key: Hashable
    remaining: float
    resources: tuple[Resource, ...]
    rate: float = 0.0


@dataclass
class Network:
    """Capacities per resource and the flows in progress."""

    capacity: dict[Resource, float] = field(default_factory=dict)
    flows: dict[Hashable, Flow] = field(default_factory=dict)
    _dirty: bool = False

    def start(self, key: Hashable, nbytes: float, resources: Sequence[Resource]) -> None:
        """A new flow of `nbytes` over `resources` (each must have a capacity)."""
        for r in resources:
            if self.capacity.get(r, 0) <= 0:
                raise ValueError(f"flow {key!r}: resource {r!r} has no capacity")
        if key in self.flows:
            raise ValueError(f"flow {key!r} is already running")
        self.flows[key] = Flow(key=key, remaining=float(nbytes), resources=tuple(resources))
        self._dirty = True

    def advance(self, dt: float) -> None:
        """Move every flow on by `dt` seconds at its current rate."""
        if dt <= 0:
            return
        self._rates()
        for f in self.flows.values():
            f.remaining = max(0.0, f.remaining - f.rate * dt)

    def next_completion(self) -> tuple[float, Hashable] | None:
        """(seconds until the next flow finishes, its key), or None without flows."""
        self._rates()
        best: tuple[float, Hashable] | None = None
        for f in self.flows.values():
            dt = f.remaining / f.rate if f.rate > 0 else float("inf")
            if best is None or dt < best[0]:
                best = (dt, f.key)
        return best

    def finish(self, key: Hashable) -> None:
        """Remove a finished flow."""
        del self.flows[key]
        self._dirty = True

    def _rates(self) -> None:
        """Max-min fair rates: repeatedly saturate the resource with the smallest fair share."""
        if not self._dirty:
            return
        self._dirty = False
        left = {}
        users: dict[Resource, list[Flow]] = {}
        for f in self.flows.values():
            for r in f.resources:
                users.setdefault(r, []).append(f)
                left[r] = self.capacity[r]
        count = {r: len(fs) for r, fs in users.items()}
        frozen: set[Hashable] = set()
        while len(frozen) < len(self.flows):
            share = min(left[r] / n for r, n in count.items() if n > 0)
            tight = [r for r, n in count.items() if n > 0 and left[r] / n <= share * (1 + 1e-12)]
            for r in tight:
                for f in users[r]:
                    if f.key in frozen:
                        continue
                    frozen.add(f.key)
                    f.rate = share
                    for r2 in f.resources:
                        left[r2] -= share
                        count[r2] -= 1
