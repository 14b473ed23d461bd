"""Faults during a scale-out: a seed's link cut mid-pull, a seed SIGKILLed, the planner restarted, and
1 % loss on one rack.

Each run has two disk seeds (h00, h01) and a tree of loaders; the fault hits h01 (or the planner, or
rack 1) while the first pulls are under way. Every loader must end verified, or failed with a clear
error, within the run's bound. Latency: this kernel has no netem, so the rack gets loss only (said in
the output).
"""

from __future__ import annotations

import time

from bench.fleet.hosts import PLANNER_PORT
from bench.fleet.run import Fault, FleetConfig, FleetContext, planner_env

FAULTS = ("cut", "kill", "planner-restart", "loss")
AT_S = 3.0  # after the start signal: the first pulls are under way (one takes 8 s at 500 Mbit/s)


def config(name: str, *, loaders: int, model_bytes: int, nic_mbit: float, timeout_s: float) -> FleetConfig:
    """The fleet a fault runs on: two seeds; rack 1 of two racks for the loss."""
    racks = 2 if name == "loss" else 0
    return FleetConfig(
        loaders=loaders,
        seeds=2,
        racks=racks,
        nic_mbit=nic_mbit,
        uplink_mbit=0.0,
        model_bytes=model_bytes,
        timeout_s=timeout_s,
    )


def _cut(ctx: FleetContext) -> str:
    ctx.network.cut("h01")
    return "h01's link down (switch side): its pulls see silence"


def _kill(ctx: FleetContext) -> str:
    ctx.hosts.kill(ctx.seeds["h01"])
    return f"seed on h01 (pid {ctx.seeds['h01'].proc.pid}) SIGKILLed"


def _restart_planner(ctx: FleetContext) -> str:
    assert ctx.planner is not None
    ctx.hosts.kill(ctx.planner)
    down = time.time()
    time.sleep(2.0)
    ctx.planner = ctx.hosts.start_planner(db=ctx.planner_db, env=planner_env(ctx.cfg))
    took = time.time() - down
    return f"planner SIGKILLed, restarted on the same database (port {PLANNER_PORT}) after {took:.1f} s"


def _loss(ctx: FleetContext) -> str:
    rack1 = [h.name for h in ctx.network.topology.hosts if h.rack == 1]
    ctx.network.degrade(rack1, loss_pct=1.0)
    return f"1 % loss on rack 1 ({len(rack1)} hosts; no added latency: this kernel has no netem)"


def faults_for(name: str, at_s: float = AT_S) -> tuple[Fault, ...]:
    """The scheduled fault of scenario `name`, `at_s` after the start signal (loss: from the start)."""
    if name == "cut":
        return (Fault(name="cut h01", at_s=at_s, action=_cut),)
    if name == "kill":
        return (Fault(name="kill seed h01", at_s=at_s, action=_kill),)
    if name == "planner-restart":
        return (Fault(name="planner restart", at_s=at_s, action=_restart_planner),)
    if name == "loss":
        return (Fault(name="loss rack 1", at_s=0.0, action=_loss),)
    raise ValueError(f"fault {name!r}: one of {FAULTS}")
