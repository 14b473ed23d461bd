"""One fleet run: bring the network up, start planner, storage and seeds, start N instances, give the
start signal, apply faults on schedule, wait until every instance is verified or failed, collect.

Every time in the result is seconds after the start signal (`go`). What each instance did comes
from its own files: the events it wrote (bench.fleet.instance), `rfork load --json` (source,
attempts, verified, verified_at) and its log (the planner's answers with their times).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.fleet.hosts import CpuSampler, Hosts, Proc
from bench.fleet.network import Network, build_topology

log = logging.getLogger(__name__)

MODES = ("tree", "first-seed", "storage")


@dataclass(frozen=True, kw_only=True)
class FleetConfig:
    """What to emulate: hosts, rates, the model, the planner's settings."""

    loaders: int = 8
    seeds: int = 1  # disk seeds, on h00.. (a fault scenario uses two)
    racks: int = 0  # 0: one flat bridge
    nic_mbit: float = 500.0
    uplink_mbit: float = 0.0  # per rack and direction (0: not shaped)
    storage_mbit: float | None = None  # the storage host's link (None: one host NIC)
    model_bytes: int = 500_000_000
    max_pulls: int = 2
    rack_hold: bool = False
    policy: str = "load_aware"
    transfer_timeout_s: float = 5.0
    timeout_s: float = 600.0  # the whole run's bound: an instance not done by then is a failure
    planner_port_ui: int = 0  # > 0: forward the planner's /ui to 127.0.0.1:this port (bench.fleet.ui)
    # the first seed's host also runs one instance that loads over shm from it (two instances on one
    # host: shm inside it, tcp across hosts)
    shm_pair: bool = False

    @property
    def storage_rate_mbit(self) -> float:
        return self.nic_mbit if self.storage_mbit is None else self.storage_mbit

    def __post_init__(self) -> None:
        if self.loaders < 1 or self.seeds < 1 or self.model_bytes < 1 << 20 or self.max_pulls < 1:
            raise ValueError("need loaders >= 1, seeds >= 1, model_bytes >= 1 MiB, max_pulls >= 1")
        if self.nic_mbit <= 0 or self.timeout_s <= 0:
            raise ValueError("nic_mbit and timeout_s must be positive")


@dataclass(frozen=True, kw_only=True)
class Fault:
    """Something done to the fleet `at_s` after the start signal (or when `when` first returns true)."""

    name: str
    at_s: float
    action: Callable[[FleetContext], str]  # returns what it did, for the report
    when: Callable[[FleetContext], bool] | None = None


@dataclass
class FleetContext:
    """What a fault's action can reach."""

    cfg: FleetConfig
    network: Network
    hosts: Hosts
    seeds: dict[str, Proc]
    planner: Proc | None
    workdir: Path
    planner_db: Path
    go: float = 0.0
    notes: list[dict[str, Any]] = field(default_factory=list)


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_ASSIGNED = re.compile(r"rank \d+: assigned (\w+)")
_BUSY = re.compile(r"rank \d+: every seed busy; asking again in ([\d.]+) s")


def _stamp(line: str) -> float | None:
    m = _STAMP.match(line)
    if not m:
        return None
    return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def parse_instance_log(text: str) -> dict[str, Any]:
    """The planner's answers as an instance logged them: leases (time, seed) and 429 waits."""
    leases: list[tuple[float, str]] = []
    waits: list[tuple[float, float]] = []
    for line in text.splitlines():
        t = _stamp(line)
        if t is None:
            continue
        if m := _ASSIGNED.search(line):
            leases.append((t, m.group(1)))
        elif m := _BUSY.search(line):
            waits.append((t, float(m.group(1))))
    return {"leases": leases, "waits": waits}


def parse_planner_log(text: str, go: float) -> list[dict[str, Any]]:
    """The planner's decisions (planner.decisions at DEBUG), times relative to `go`."""
    out = []
    for line in text.splitlines():
        if "planner.decisions:" not in line:
            continue
        t = _stamp(line)
        if t is not None:
            out.append({"t": round(t - go, 3), "decision": line.split("planner.decisions: ", 1)[1]})
    return out


def _instance_row(p: Proc, go: float, host_of_instance: dict[str, str], ctx: FleetContext) -> dict[str, Any]:
    ev = p.events()
    row: dict[str, Any] = {
        "name": p.name,
        "host": p.host,
        "rack": ctx.network.topology.host(p.host).rack,
        "process_started": round(p.started - go, 3),
        "imported": round(ev["imported"] - go, 3) if "imported" in ev else None,
    }
    if "fetch_done" in ev:
        row["fetch_s"] = round(ev["fetch_done"] - ev["fetch_started"], 3)
        row["fetch_verified"] = bool(ev.get("fetch_verified"))
    parsed = parse_instance_log(p.tail(1 << 22))
    asks = [t for t, _ in parsed["waits"]] + [t for t, _ in parsed["leases"]]
    row["first_ask"] = round(min(asks) - go, 3) if asks else None
    row["asked_again"] = len(parsed["waits"])
    row["busy_wait_s"] = round(sum(w for _, w in parsed["waits"]), 2)
    row["leases"] = [{"t": round(t - go, 3), "seed": host_of_instance.get(s, s)} for t, s in parsed["leases"]]
    result: dict[str, Any] | None = None
    if p.json_path is not None and p.json_path.exists():
        result = json.loads(p.json_path.read_text())
    if result is None:
        row.update(
            ok=False,
            verified=False,
            source=None,
            parent=None,
            ready_s=None,
            error=_last_error(p),
            exit_code=p.proc.poll(),
        )
        return row
    ok_attempt = next((a for a in reversed(result.get("attempts", [])) if a.get("ok")), None)
    parent_id = ok_attempt.get("instance_id") if ok_attempt else None
    source = str(result["source"])
    row.update(
        ok=True,
        source=source,
        parent=("storage" if "fetch_done" in ev else "disk")
        if source == "disk"
        else host_of_instance.get(str(parent_id), str(parent_id)),
        verified=bool(result["verified"]) or bool(ev.get("fetch_verified")),
        digests_compared=bool(result["verified"]),
        load_s=round(float(result["seconds"]), 3),
        ready_s=round(float(result["verified_at"]) - go, 3),
        failed_attempts=[
            {
                "seed": host_of_instance.get(str(a.get("instance_id")), a.get("instance_id")),
                "error": str(a.get("error"))[:200],
            }
            for a in result.get("attempts", [])
            if not a.get("ok")
        ],
        phases={k: round(float(v), 3) for k, v in result.get("phases", {}).items()},
        instance_ids=list(result.get("instance_ids", [])),
    )
    if row["leases"]:
        row["pull_started"] = row["leases"][-1]["t"]
        row["pull_s"] = round(float(ok_attempt["seconds"]), 3) if ok_attempt else None
    return row


def _last_error(p: Proc) -> str:
    lines = [ln for ln in p.tail(20000).splitlines() if "error" in ln.lower() or "Error" in ln]
    return lines[-1][-300:] if lines else f"no result (exit {p.proc.poll()})"


def run_fleet(
    cfg: FleetConfig,
    mode: str,
    *,
    faults: tuple[Fault, ...] = (),
    checkpoint: Path | None = None,
    progress: Callable[[str], None] | None = None,
    keep: bool = False,
    on_planner_up: Callable[[FleetContext], None] | None = None,
) -> dict[str, Any]:
    """One run of `mode` (tree, first-seed, storage) on a fresh network; the result document."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    say = progress or (lambda _msg: None)
    workdir = Path(tempfile.mkdtemp(prefix="rfork-fleet-"))
    hosts_n = cfg.seeds + cfg.loaders
    topo = build_topology(
        hosts=hosts_n,
        racks=cfg.racks,
        nic_mbit=cfg.nic_mbit,
        uplink_mbit=cfg.uplink_mbit,
        storage_mbit=cfg.storage_rate_mbit,
    )
    network = Network(topo)
    hosts = Hosts(network, workdir)
    sampler = CpuSampler()
    forwarder: Any = None
    try:
        say(f"network: {hosts_n} hosts, {cfg.racks or 'no'} racks, {cfg.nic_mbit:g} Mbit/s NICs")
        network.up()
        if checkpoint is None:
            # imported here: `rfork bench --help` imports every benchmark (start-up time)
            from rfork.weights.synthetic import write_synthetic_checkpoint

            say(f"writing a {cfg.model_bytes / 1e9:.2f} GB synthetic checkpoint")
            checkpoint = write_synthetic_checkpoint(workdir / "checkpoint", size_bytes=cfg.model_bytes)
        db = workdir / "planner.db"
        ctx = FleetContext(
            cfg=cfg, network=network, hosts=hosts, seeds={}, planner=None, workdir=workdir, planner_db=db
        )
        say("storage host: serving the checkpoint over HTTP")
        hosts.start_storage(checkpoint)
        seed_names = [f"h{i:02d}" for i in range(cfg.seeds)]
        loader_hosts = [f"h{i:02d}" for i in range(cfg.seeds, hosts_n)]
        host_of_instance: dict[str, str] = {}
        if mode != "storage":
            say("planner host: rfork planner serve (SQLite)")
            ctx.planner = hosts.start_planner(db=db, env=planner_env(cfg))
            if cfg.planner_port_ui:
                from bench.fleet.ui import Forwarder

                forwarder = Forwarder(
                    network.ns("planner"), hosts.address("planner"), 8470, cfg.planner_port_ui
                ).start()
            if on_planner_up is not None:
                on_planner_up(ctx)
            for h in seed_names:
                say(f"seed on {h}: rfork seed from its local checkpoint")
                providers = ("tcp", "shm") if cfg.shm_pair and h == seed_names[0] else ("tcp",)
                proc, info = hosts.start_seed(h, checkpoint, providers=providers, max_pulls=cfg.max_pulls)
                ctx.seeds[h] = proc
                for iid in info["instance_ids"]:
                    host_of_instance[iid] = h
        procs = []
        for i, h in enumerate(loader_hosts):
            procs.append(
                hosts.start_instance(
                    f"i{i:02d}-{h}", h, loader_args(cfg, mode, hosts, checkpoint), fetch=mode == "storage"
                )
            )
        if cfg.shm_pair and mode != "storage":
            pair = [a if a != "tcp" else "shm" for a in loader_args(cfg, mode, hosts, checkpoint)]
            procs.append(hosts.start_instance(f"i{len(procs):02d}-{seed_names[0]}-shm", seed_names[0], pair))
        say(f"{len(procs)} instances starting (imports before the start signal)")
        hosts.wait_imported(procs, timeout_s=600)
        sampler.start()
        time.sleep(0.5)  # a baseline sample before the start
        ctx.go = go = hosts.go(procs)
        say("start signal given")
        fault_threads = [_schedule(f, ctx) for f in faults]
        deadline = time.monotonic() + cfg.timeout_s
        pending = list(procs)
        while pending and time.monotonic() < deadline:
            pending = [
                p for p in pending if not (p.json_path and p.json_path.exists()) and p.proc.poll() is None
            ]
            time.sleep(0.1)
        ended = time.time()
        for t in fault_threads:
            t.join(timeout=1)
        for p in procs:  # the loaders' own instance ids (tree: they became seeds)
            if p.json_path is not None and p.json_path.exists():
                for iid in json.loads(p.json_path.read_text()).get("instance_ids", []):
                    host_of_instance[iid] = p.host
        rows = [_instance_row(p, go, host_of_instance, ctx) for p in procs]
        sampler.stop()
        planner_log = ctx.planner.tail(1 << 24) if ctx.planner is not None else ""
        return {
            "mode": mode,
            "config": asdict(cfg),
            "faults": ctx.notes,
            "instances": rows,
            "all_ready_s": max((r["ready_s"] or 0.0) for r in rows) if all(r["ok"] for r in rows) else None,
            "all_verified": all(r["ok"] and r["verified"] for r in rows),
            "failed": [r["name"] for r in rows if not r["ok"]],
            "cpu": sampler.summary(go, ended),
            "planner_decisions": parse_planner_log(planner_log, go),
            "timed_out": bool(pending),
        }
    finally:
        sampler.stop()
        if forwarder is not None:
            forwarder.stop()
        hosts.close()
        network.down()
        if keep:
            log.warning("work directory kept: %s", workdir)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def planner_env(cfg: FleetConfig) -> dict[str, str]:
    """The planner's settings for the run (RFORK_* variables)."""
    return {
        "RFORK_SELECTION_POLICY": cfg.policy,
        "RFORK_RACK_HOLD": "1" if cfg.rack_hold else "0",
        # before any pull is recorded: one seed NIC (loaders that will serve pull alone: solo_pulls_for_seeds)
        "RFORK_ASSUMED_PULL_GBPS": f"{cfg.nic_mbit / 8e3:g}",
        "RFORK_HEARTBEAT_TTL_S": "10",
    }


def loader_args(cfg: FleetConfig, mode: str, hosts: Hosts, checkpoint: Path) -> list[str]:
    """`rfork load` arguments of an instance in `mode`."""
    if mode == "storage":
        return ["--checkpoint", "FETCHED", "--no-serve"]
    return [
        "--planner",
        hosts.planner_url,
        "--insecure",
        "--checkpoint-id",
        model_name(checkpoint),
        "--provider",
        "tcp",
        *([] if mode == "tree" else ["--no-serve"]),
        "--fallback-gbps",
        "0",
        "--max-concurrent-pulls",
        str(cfg.max_pulls),
        "--timeout",
        f"{cfg.transfer_timeout_s:g}",
    ]


def model_name(checkpoint: Path) -> str:
    """The model name in the checkpoint's identity (what `--checkpoint-id` asks the planner for)."""
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from rfork.weights.checkpoint import read_checkpoint_info

    return read_checkpoint_info(checkpoint).model_name


def _schedule(fault: Fault, ctx: FleetContext) -> threading.Thread:
    def fire() -> None:
        wait_until = ctx.go + fault.at_s
        while time.time() < wait_until or (fault.when is not None and not fault.when(ctx)):
            time.sleep(0.05)
            if time.time() > ctx.go + ctx.cfg.timeout_s:
                return
        t = time.time() - ctx.go
        try:
            what = fault.action(ctx)
        except Exception as exc:  # noqa: BLE001 - a fault that fails is reported, the run goes on
            what = f"failed: {exc}"
        ctx.notes.append({"fault": fault.name, "t": round(t, 3), "what": what})
        log.warning("fault %s at %.2f s: %s", fault.name, t, what)

    th = threading.Thread(target=fire, name=f"fault-{fault.name}", daemon=True)
    th.start()
    return th
