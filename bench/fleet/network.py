"""The emulated network: one network namespace per host, a bridge per rack, shaped links.

Layout (every name carries `PREFIX` and the run's tag, so a run cleans up what a killed run left):

    {prefix}-sw          the switch: a namespace that holds the bridges ("core", "r0", "r1", ...)
    {prefix}-h03         a host: eth0 (its NIC) <-veth-> "h03" on its rack's bridge in the switch
    {prefix}-storage     the storage host, on the core bridge through one capped link
    {prefix}-planner     the planner host, on the core bridge (not shaped)

A rack's bridge joins the core through a veth pair "u0a" (rack side) / "u0b" (core side) when the
fleet has racks; a flat fleet puts every host on the core bridge. Rates are enforced on egress
(htb), so each link is shaped in both directions: a host's upload on eth0 in its own namespace, its
download on its port in the switch; an uplink on both of its ends. All addresses are in
198.18.0.0/15 (reserved for benchmarking) and live only in namespaces made here; the root namespace
gets no address and no route, so nothing outside this machine is ever addressed.

Latency and loss: this kernel has no netem (CONFIG_NET_SCH_NETEM is off), so loss is an nftables
rule (`numgen random mod 10000 < N drop`) on the switch ports of the affected hosts; latency is not
emulated by the kernel (see `Network.degrade`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "rfkfleet"
NETNS_DIR = Path("/run/netns")
BENCH_NET = ipaddress.ip_network("198.18.0.0/15")
PREFIXLEN = BENCH_NET.prefixlen


class NetworkError(RuntimeError):
    """A namespace, link or qdisc could not be set up; the message carries the failed command."""


@dataclass(frozen=True, kw_only=True)
class HostSpec:
    """One emulated host: its name, rack (None: on the core bridge), NIC rate in Mbit/s (0: unshaped)."""

    name: str
    rack: int | None
    nic_mbit: float
    address: str

    def __post_init__(self) -> None:
        if ipaddress.ip_address(self.address) not in BENCH_NET:
            raise ValueError(f"host {self.name}: {self.address} is not in {BENCH_NET}")
        if len(self.name) > 12 or not self.name.replace("-", "").isalnum():
            raise ValueError(f"host name {self.name!r}: at most 12 letters, digits or '-'")


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Hosts in racks, each rack joined to the core by an uplink of `uplink_mbit` (0: unshaped)."""

    hosts: tuple[HostSpec, ...]
    racks: int = 0
    uplink_mbit: float = 0.0

    def host(self, name: str) -> HostSpec:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)


def build_topology(
    *,
    hosts: int,
    racks: int,
    nic_mbit: float,
    uplink_mbit: float,
    storage_mbit: float,
) -> Topology:
    """`hosts` hosts h00.. spread round-robin over `racks` racks (0: flat), a storage host and a planner.

    Host hNN in rack r gets 198.18.r.(10+NN); storage 198.19.0.2; planner 198.19.0.1.
    """
    if hosts < 1 or hosts > 200 or racks < 0 or racks > 16:
        raise ValueError("hosts must be 1..200 and racks 0..16")
    specs = [
        HostSpec(
            name=f"h{i:02d}",
            rack=(i % racks) if racks else None,
            nic_mbit=nic_mbit,
            address=f"198.18.{(i % racks) if racks else 0}.{10 + i}",
        )
        for i in range(hosts)
    ]
    specs.append(HostSpec(name="storage", rack=None, nic_mbit=storage_mbit, address="198.19.0.2"))
    specs.append(HostSpec(name="planner", rack=None, nic_mbit=0, address="198.19.0.1"))
    return Topology(hosts=tuple(specs), racks=racks, uplink_mbit=uplink_mbit)


def run_cmd(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `ip`/`tc`/`nft`; NetworkError with the command and its stderr when it fails and `check`."""
    proc = subprocess.run(list(args), capture_output=True, text=True, check=False, timeout=30)
    if check and proc.returncode != 0:
        raise NetworkError(f"{' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def can_make_namespaces() -> str | None:
    """None when this process can create network namespaces and shape links; else why not, in one line."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True, check=False).returncode != 0:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}-probe{os.getpid()}"
    made = run_cmd(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        veth = run_cmd(
            ["ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"], check=False
        )
        if veth.returncode != 0:
            return f"veth pairs are not available: {veth.stderr.strip()}"
        htb = run_cmd(
            ["tc", "-n", probe, "qdisc", "add", "dev", "pa", "root", "handle", "1:", "htb"], check=False
        )
        if htb.returncode != 0:
            return f"tc htb is not available: {htb.stderr.strip()}"
    finally:
        run_cmd(["ip", "netns", "del", probe], check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_namespaces() -> list[str]:
    """Namespaces of earlier runs whose owner process is gone (names `{PREFIX}-{pid}-...`)."""
    out = []
    listing = run_cmd(["ip", "netns", "list"], check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            out.append(name)
    return out


def delete_namespace(name: str) -> None:
    """Kill what runs inside `name` (processes a harness started there), then delete it."""
    pids = run_cmd(["ip", "netns", "pids", name], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)
    run_cmd(["ip", "netns", "del", name], check=False)


def clean_stale() -> int:
    """Remove what killed runs left behind; returns how many namespaces went."""
    stale = stale_namespaces()
    for name in stale:
        log.warning("removing namespace %s left by a killed run", name)
        delete_namespace(name)
    return len(stale)


def _shape(ns: str, dev: str, mbit: float) -> None:
    """Cap `dev`'s egress in namespace `ns` at `mbit` Mbit/s (htb, one class; burst of ~2 ms)."""
    if mbit <= 0:
        return
    rate = f"{mbit:g}mbit"
    burst = max(16_000, int(mbit * 1e6 / 8 * 0.002))
    quantum = 60_000
    run_cmd(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])
    run_cmd(
        [
            "tc",
            "-n",
            ns,
            "class",
            "replace",
            "dev",
            dev,
            "parent",
            "1:",
            "classid",
            "1:10",
            "htb",
            "rate",
            rate,
            "ceil",
            rate,
            "burst",
            str(burst),
            "cburst",
            str(burst),
            "quantum",
            str(quantum),
        ]
    )


@dataclass
class Network:
    """The namespaces and links of one run; `up()` builds them, `down()` removes every one."""

    topology: Topology
    tag: str = field(default_factory=lambda: str(os.getpid()))
    made: list[str] = field(default_factory=list)

    def ns(self, host: str) -> str:
        """The namespace name of `host` ("sw" is the switch)."""
        return f"{PREFIX}-{self.tag}-{host}"

    @property
    def switch(self) -> str:
        return self.ns("sw")

    def up(self) -> None:
        """Create the switch, bridges, hosts and shaped links (NetworkError, after undoing, on failure)."""
        clean_stale()
        try:
            self._add_ns(self.switch)
            self._bridge("core")
            topo = self.topology
            if topo.racks:
                for r in range(topo.racks):
                    self._bridge(f"r{r}")
                    a, b = f"u{r}a", f"u{r}b"
                    run_cmd(["ip", "-n", self.switch, "link", "add", a, "type", "veth", "peer", "name", b])
                    run_cmd(["ip", "-n", self.switch, "link", "set", a, "master", f"r{r}", "up"])
                    run_cmd(["ip", "-n", self.switch, "link", "set", b, "master", "core", "up"])
                    _shape(self.switch, a, topo.uplink_mbit)  # rack -> core
                    _shape(self.switch, b, topo.uplink_mbit)  # core -> rack
            for h in topo.hosts:
                self._host(h)
        except BaseException:
            self.down()
            raise

    def _add_ns(self, name: str) -> None:
        run_cmd(["ip", "netns", "add", name])
        self.made.append(name)
        run_cmd(["ip", "-n", name, "link", "set", "lo", "up"])

    def _bridge(self, name: str) -> None:
        run_cmd(["ip", "-n", self.switch, "link", "add", name, "type", "bridge"])
        # forward at once: no STP listening delay on a fresh port
        run_cmd(
            [
                "ip",
                "-n",
                self.switch,
                "link",
                "set",
                name,
                "type",
                "bridge",
                "forward_delay",
                "0",
                "stp_state",
                "0",
            ]
        )
        run_cmd(["ip", "-n", self.switch, "link", "set", name, "up"])

    def _host(self, h: HostSpec) -> None:
        ns = self.ns(h.name)
        self._add_ns(ns)
        port = h.name
        run_cmd(
            [
                "ip",
                "-n",
                self.switch,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            ]
        )
        bridge = "core" if h.rack is None else f"r{h.rack}"
        run_cmd(["ip", "-n", self.switch, "link", "set", port, "master", bridge, "up"])
        run_cmd(["ip", "-n", ns, "addr", "add", f"{h.address}/{PREFIXLEN}", "dev", "eth0"])
        run_cmd(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _shape(ns, "eth0", h.nic_mbit)  # upload
        _shape(self.switch, port, h.nic_mbit)  # download

    def cut(self, host: str) -> None:
        """Take `host`'s link down on the switch side: its peers see silence, as with a pulled cable."""
        run_cmd(["ip", "-n", self.switch, "link", "set", self.topology.host(host).name, "down"])

    def restore(self, host: str) -> None:
        run_cmd(["ip", "-n", self.switch, "link", "set", self.topology.host(host).name, "up"])

    def degrade(self, hosts: Sequence[str], *, loss_pct: float) -> None:
        """Drop `loss_pct` % of the packets to and from `hosts` (nftables on their switch ports).

        Latency cannot be added by this kernel (no netem); callers say so in their output.
        """
        if loss_pct <= 0 or not hosts:
            return
        per_10k = round(loss_pct * 100)
        ports = ", ".join(f'"{self.topology.host(h).name}"' for h in hosts)
        rules = (
            "table bridge rfkloss {\n"
            "  chain drops { type filter hook forward priority 0; policy accept;\n"
            f"    iifname {{ {ports} }} numgen random mod 10000 < {per_10k} drop\n"
            f"    oifname {{ {ports} }} numgen random mod 10000 < {per_10k} drop\n"
            "  }\n}\n"
        )
        proc = subprocess.run(
            ["ip", "netns", "exec", self.switch, "nft", "-f", "-"],
            input=rules,
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
        if proc.returncode != 0:
            raise NetworkError(f"nft (loss on {list(hosts)}): {proc.stderr.strip()}")

    def exec_prefix(self, host: str) -> list[str]:
        """The argv prefix that runs a command on `host`."""
        return ["ip", "netns", "exec", self.ns(host)]

    def down(self) -> None:
        """Kill every process left in this run's namespaces and delete them (idempotent)."""
        for name in reversed(self.made):
            delete_namespace(name)
        self.made.clear()
