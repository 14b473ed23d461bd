"""A simulated scale-out burst driven by the real planner (in process, on SQLite, on simulated time).

One seed holds the model; N loaders ask at t=0. Every planner decision is the real `planner.Planner`
(embedded through planner's public API: its selection policy, leases, 429 estimate) called with
`now` = simulated time, and every 429 is handled by the loader's own wait policy
(`rfork.pull.options.BusyWait.decide`). Only the transfers are modelled: `bench.simulate.flows`
shares NIC, rack-uplink, hub and disk capacity max-min fairly. A loader that finishes is READY
`ready_overhead_s` later (verify tail, publish); with the tree on it then registers as a seed like
`Loader._become_seed` does.
"""

from __future__ import annotations

import heapq
import json
import math
import random
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.simulate.flows import Network
from bench.simulate.model import SCENARIOS, BandwidthModel, Scenario
from planner import (
    AllBusy,
    AssignmentRequest,
    NoSource,
    Planner,
    PlannerSettings,
    RegistrationRequest,
    TransferReport,
    make_policy,
    migrate,
)
from rfork.pull.options import BusyWait

# the model's names are re-exported: callers import the whole simulator from here
__all__ = [
    "SCENARIOS",
    "BandwidthModel",
    "FleetSim",
    "Scenario",
    "SimResult",
    "hub_baseline",
    "migrated_template",
]

PROVIDER = "efa"
IDENTITY: dict[str, Any] = {
    "model": "sim-140b",
    "revision": "main",
    "fingerprint": "simulated",
    "dtype": "bfloat16",
    "quantization": "none",
    "tp": 1,
    "pp": 1,
    "ep": 1,
    "dp": 1,
    "framework": "rfork-sim",
    "framework_version": "1",
    "device_kind": "cuda:sm90",
}


@dataclass(kw_only=True)
class SimResult:
    """One simulated burst."""

    scenario: str
    instances: int
    all_ready_s: float
    ready_s: list[float]
    sources: dict[str, int]  # seed / disk counts
    parents: dict[str, str]  # loader node -> node it pulled from ("disk" for a fallback)
    max_pulls_per_seed: int
    planner_calls: int
    busy_answers: int
    wall_s: float
    decisions_made: int  # assignment requests answered (leases, 429s, no_source)
    decision_s: float  # wall time inside Planner.assign, summed over them
    decisions: list[dict[str, Any]] = field(default_factory=list)


BeforeAssign = Callable[[Path, dict[str, Any], int], None]


def _manifest(nbytes: int, origin: str) -> str:
    return json.dumps(
        {
            "rank": 0,
            "origin": origin,
            "checksum_algorithm": "simulated",
            "regions": [{"index": 0, "nbytes": nbytes, "descriptor": "c2lt"}],
            "tensors": [
                {
                    "name": "weights",
                    "dtype": "uint8",
                    "shape": [nbytes],
                    "nbytes": nbytes,
                    "region": 0,
                    "offset": 0,
                    "checksum": "0",
                }
            ],
        }
    )


def migrated_template(directory: Path) -> Path:
    """An empty planner database at the newest schema (copied for every run)."""
    path = directory / "template.db"
    if not path.exists():
        migrate(f"sqlite:///{path}")
    return path


class FleetSim:
    """One burst: N loaders against one seed, on a fresh copy of `template` in `workdir`."""

    def __init__(
        self,
        *,
        model: BandwidthModel,
        scenario: Scenario,
        instances: int,
        template: Path,
        workdir: Path,
        wait: BusyWait | None = None,
        seed: int = 0,
        before_assign: BeforeAssign | None = None,
        record_decisions: bool = False,
        rack_hold: bool | None = None,
        ask_order: list[int] | None = None,
    ) -> None:
        if instances < 1:
            raise ValueError(f"instances: need at least 1, got {instances}")
        self.model = model
        self.scenario = scenario
        self.n = instances
        self.wait = wait or BusyWait()
        self.rng = random.Random(seed)
        self.before_assign = before_assign
        self.record = record_decisions
        # the order in which the loaders first ask at t=0 (default 0..n-1): a real run's order, to
        # compare like with like (bench.fleet.compare)
        if ask_order is not None and sorted(ask_order) != list(range(instances)):
            raise ValueError("ask_order: a permutation of range(instances)")
        self.ask_order = list(range(instances)) if ask_order is None else list(ask_order)
        self.db_path = workdir / f"sim-{scenario.name}-{instances}.db"
        self.db_path.unlink(missing_ok=True)
        with sqlite3.connect(template) as src, sqlite3.connect(self.db_path) as dst:
            src.backup(dst)
        url = f"sqlite:///{self.db_path}"
        settings = PlannerSettings(
            db_url=url,
            insecure=True,
            heartbeat_ttl_s=1e9,  # simulated seeds never miss a heartbeat
            lease_ttl_s=1e6,
            # what an operator sets before any pull is recorded: a loader that will serve pulls alone
            # (solo_pulls_for_seeds), at a seed's whole NIC; one that will not shares the seed's limit
            assumed_pull_gbps=model.nic_bps / 1e9 / (1 if scenario.tree else model.max_concurrent_pulls),
            selection_policy=scenario.policy,
            # racked fleets: a loader whose rack has a seed waits for it rather than cross the spine
            rack_hold=(model.racks > 0 and scenario.policy == "load_aware")
            if rack_hold is None
            else rack_hold,
            db_pool_size=2,
        )
        self.planner = Planner.open(settings, policy=make_policy(scenario.policy, rng=random.Random(seed)))
        self.t0 = float(int(time.time()))  # planner times are UNIX seconds: simulated t=0 is now
        self.net = Network()
        self.node_of_instance: dict[str, str] = {}
        self.rack_of: dict[str, str] = {}

    # --- helpers

    def _node(self, i: int) -> str:
        return "seed0" if i < 0 else f"n{i}"

    def _rack(self, i: int) -> str:
        if self.model.racks == 0:
            return "rack0"
        return "rack0" if i < 0 else f"rack{i % self.model.racks}"

    def _labels(self, i: int) -> dict[str, str]:
        return {"node": self._node(i), "rack": self._rack(i), "zone": "zone0"}

    def _register_seed(self, i: int, now: float) -> str:
        body = RegistrationRequest.model_validate(
            {
                "identity": IDENTITY,
                "labels": self._labels(i),
                "ranks": [{"rank": 0, "provider": PROVIDER, "address": "c2lt", "backends": [PROVIDER]}],
                "max_concurrent_pulls": self.model.max_concurrent_pulls,
            }
        )
        iid = self.planner.register(body, now).id
        # the first seed loaded from disk and anchors the identity's digests (#12); the rest pulled
        origin = "disk" if i < 0 else "peer"
        self.planner.put_manifest(iid, 0, _manifest(self.model.nbytes, origin), now)
        self.planner.set_status(iid, "READY", now)
        self.node_of_instance[iid] = self._node(i)
        return iid

    def _capacities(self) -> None:
        m, cap = self.model, self.net.capacity
        for i in range(-1, self.n):
            cap[("tx", self._node(i))] = m.nic_bps
            cap[("rx", self._node(i))] = m.nic_bps
            cap[("disk", self._node(i))] = m.disk_gbyte_s * 1e9
        for r in range(max(m.racks, 1)):
            cap[("up", f"rack{r}")] = m.uplink_gbit_s * 1e9 / 8
            cap[("down", f"rack{r}")] = m.uplink_gbit_s * 1e9 / 8

    def _pull_path(self, src_node: str, src_rack: str, i: int) -> list[Any]:
        path: list[Any] = [("tx", src_node), ("rx", self._node(i))]
        if self.model.racks and src_rack != self._rack(i):
            path += [("up", src_rack), ("down", self._rack(i))]
        return path

    # --- the run

    def run(self) -> SimResult:
        """Simulate until every loader is READY."""
        wall0 = time.perf_counter()
        m = self.model
        self._capacities()
        self._register_seed(-1, self.t0)
        fallback_s = m.nbytes / (m.disk_gbyte_s * 1e9)
        events: list[tuple[float, int, str, int]] = []
        seq = 0
        for i in self.ask_order:
            events.append((0.0, seq, "ask", i))
            seq += 1
        heapq.heapify(events)
        first_ask: dict[int, float] = {}
        lease: dict[int, tuple[str, float, str]] = {}  # loader -> (lease id, start, seed instance)
        active: dict[str, int] = {}
        max_active = 0
        parents: dict[str, str] = {}
        ready: dict[int, float] = {}
        sources = {"seed": 0, "disk": 0}
        calls = busy = 0
        decision_s = 0.0
        decisions: list[dict[str, Any]] = []
        t = 0.0
        while events or len(self.net):
            nxt = self.net.next_completion()
            t_flow = t + nxt[0] if nxt is not None else math.inf
            t_event = events[0][0] if events else math.inf
            if t_flow <= t_event and nxt is not None:
                self.net.advance(t_flow - t)
                t = t_flow
                done = self.net.finished()
                for key in done or [nxt[1]]:
                    self.net.finish(key)
                    heapq.heappush(events, (t + m.ready_overhead_s, seq, "ready", key[1]))  # type: ignore[index]
                    seq += 1
                continue
            self.net.advance(t_event - t)
            t, _, kind, i = heapq.heappop(events)
            now = self.t0 + t
            if kind == "ready":
                ready[i] = t
                if i in lease:
                    lease_id, started, seed_id = lease.pop(i)
                    active[seed_id] -= 1
                    self.planner.report(
                        lease_id,
                        TransferReport(
                            outcome="success", bytes=m.nbytes, seconds=t - started, backend=PROVIDER
                        ),
                        now,
                    )
                    calls += 1
                if self.scenario.tree:
                    self._register_seed(i, now)
                continue
            first_ask.setdefault(i, t)
            body_json = {
                "identity": IDENTITY,
                "rank": 0,
                "labels": self._labels(i),
                "providers": [PROVIDER],
                "backends": [PROVIDER],
                "fallback_s": fallback_s,
                "serves_after": m.max_concurrent_pulls if self.scenario.tree else 0,
                "waited_s": t - first_ask[i],
            }
            if self.before_assign is not None:
                self.before_assign(self.db_path, body_json, calls)
            calls += 1
            decision: dict[str, Any] = {"call": calls - 1, "t": t, "loader": i}
            request = AssignmentRequest.model_validate(body_json)
            t_call = time.perf_counter()
            try:
                assignment = self.planner.assign(request, now)
            except AllBusy as exc:
                decision_s += time.perf_counter() - t_call
                busy += 1
                decision.update(result="all_busy", retry_after_s=exc.retry_after_s, fallback=exc.fallback)
                pause = self.wait.decide(exc, t - first_ask[i], self.rng)
                if pause is None:
                    self._fallback(i, parents, sources)
                else:
                    heapq.heappush(events, (t + pause, seq, "ask", i))
                    seq += 1
            except NoSource:
                decision_s += time.perf_counter() - t_call
                decision.update(result="no_source")
                self._fallback(i, parents, sources)
            else:
                decision_s += time.perf_counter() - t_call
                cand = assignment.candidates[0]
                seed_id = cand.instance_id
                decision.update(result="leased", candidates=[c.instance_id for c in assignment.candidates])
                lease[i] = (assignment.id, t, seed_id)
                active[seed_id] = active.get(seed_id, 0) + 1
                max_active = max(max_active, active[seed_id])
                src_node = self.node_of_instance[seed_id]
                parents[self._node(i)] = src_node
                sources["seed"] += 1
                self.net.start(("pull", i), m.nbytes, self._pull_path(src_node, cand.labels.rack, i))
            if self.record:
                decisions.append(decision)
        self.planner.close()
        times = [ready[i] for i in range(self.n)]
        return SimResult(
            scenario=self.scenario.name,
            instances=self.n,
            all_ready_s=max(times),
            ready_s=times,
            sources=sources,
            parents=parents,
            max_pulls_per_seed=max_active,
            planner_calls=calls,
            busy_answers=busy,
            wall_s=time.perf_counter() - wall0,
            decisions_made=calls - sources["seed"],  # every other call reported a lease
            decision_s=decision_s,
            decisions=decisions,
        )

    def _fallback(self, i: int, parents: dict[str, str], sources: dict[str, int]) -> None:
        parents[self._node(i)] = "disk"
        sources["disk"] += 1
        self.net.start(("disk", i), self.model.nbytes, [("disk", self._node(i))])


def hub_baseline(model: BandwidthModel, n: int) -> float:
    """All n loaders from the hub at once, through the same flow model (hub egress + each NIC)."""
    net = Network()
    net.capacity[("hub",)] = model.hub_gbit_s * 1e9 / 8
    for i in range(n):
        net.capacity[("rx", i)] = model.nic_bps
        net.start(("hub", i), model.nbytes, [("hub",), ("rx", i)])
    t = 0.0
    while len(net):
        nxt = net.next_completion()
        assert nxt is not None
        net.advance(nxt[0])
        t += nxt[0]
        for k in net.finished() or [nxt[1]]:
            net.finish(k)
    return t + model.ready_overhead_s
