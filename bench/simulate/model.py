"""The simulated fleet: its hardware (bandwidths, limits) and the planner scenarios to compare.

Plain data, no planner import, so `rfork simulate scale-out --help` stays instant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class BandwidthModel:
    """The fleet's hardware. Network rates in Gbit/s (as NICs are sold), disk in GB/s."""

    model_gb: float = 140.0  # bytes per instance (10^9), one rank per instance
    nic_gbit_s: float = 400.0  # per node, each direction
    max_concurrent_pulls: int = 2  # per seed (the planner's limit)
    disk_gbyte_s: float = 5.0  # local disk read per node: the loaders' fallback
    hub_gbit_s: float = 200.0  # aggregate egress of the hub / shared storage (the all-from-hub baseline)
    racks: int = 0  # 0: flat network; else loaders spread round-robin over this many racks
    uplink_gbit_s: float = 1600.0  # per rack and direction, crossed by inter-rack pulls (racks > 0)
    ready_overhead_s: float = 1.0  # pull done -> READY (verify tail, publish); also in the ideal

    def __post_init__(self) -> None:
        for name in ("model_gb", "nic_gbit_s", "disk_gbyte_s", "hub_gbit_s", "uplink_gbit_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.max_concurrent_pulls < 1 or self.racks < 0 or self.ready_overhead_s < 0:
            raise ValueError("max_concurrent_pulls >= 1, racks >= 0 and ready_overhead_s >= 0 required")

    @property
    def nbytes(self) -> int:
        return int(self.model_gb * 1e9)

    @property
    def nic_bps(self) -> float:
        return self.nic_gbit_s * 1e9 / 8

    def ideal_tree_s(self, n: int) -> float:
        """Every holder serves one newcomer at full NIC rate per generation: ceil(log2(n+1)) hops."""
        return math.ceil(math.log2(n + 1)) * (self.nbytes / self.nic_bps + self.ready_overhead_s)

    def hub_s(self, n: int) -> float:
        """All n at once from the hub (fair share of its egress, capped by each NIC)."""
        return self.nbytes / min(self.nic_bps, self.hub_gbit_s * 1e9 / 8 / n) + self.ready_overhead_s

    def disk_s(self) -> float:
        """One instance from its own local disk."""
        return self.nbytes / (self.disk_gbyte_s * 1e9) + self.ready_overhead_s


@dataclass(frozen=True)
class Scenario:
    """A planner policy and whether loaded instances become seeds (the tree)."""

    name: str
    policy: str
    tree: bool


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("tree-load-aware", "load_aware", True),
        Scenario("tree-random", "random", True),
        Scenario("tree-rendezvous", "rendezvous", True),
        Scenario("first-seed-only", "load_aware", False),
    )
}
