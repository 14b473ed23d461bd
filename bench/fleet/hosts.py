"""The processes on the emulated hosts: planner, storage, seeds and instances, and a CPU sampler.

Every process runs in its host's namespace (`ip netns exec`) in a session of its own, is tracked here,
and is ended by `Hosts.close()` (SIGTERM, then SIGKILL); `Network.down()` kills whatever is left in
the namespaces. Instances start early and wait for a byte on stdin (bench.fleet.instance), which
`Hosts.go()` writes to all of them at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.fleet.network import Network, Topology
from bench.processes import CHECKOUT, HarnessError

log = logging.getLogger(__name__)

PLANNER_PORT = 8470
STORAGE_PORT = 8080


@dataclass
class Proc:
    """One process on one host."""

    name: str
    host: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    started: float
    events_path: Path | None = None
    json_path: Path | None = None

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def events(self) -> dict[str, Any]:
        if self.events_path is None:
            return {}
        try:
            return dict(json.loads(self.events_path.read_text()))
        except (OSError, ValueError):
            return {}


class CpuSampler:
    """Samples /proc/stat every `interval_s`: (time, fraction of all cores busy) pairs."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-cpu", daemon=True)

    @staticmethod
    def _read() -> tuple[int, int]:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        values = [int(v) for v in fields]
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        return sum(values[:8]), idle

    def _run(self) -> None:
        total0, idle0 = self._read()
        while not self._stop.wait(self.interval_s):
            total, idle = self._read()
            dt = total - total0
            if dt > 0:
                self.samples.append((time.time(), 1.0 - (idle - idle0) / dt))
            total0, idle0 = total, idle

    def start(self) -> CpuSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def summary(self, since: float, until: float, *, busy: float = 0.95) -> dict[str, Any]:
        """Mean busy fraction over [since, until] and the share of samples at or above `busy`."""
        window = [b for t, b in self.samples if since <= t <= until]
        if not window:
            return {"mean_busy": None, "saturated_share": None, "saturated": False, "samples": 0}
        share = sum(1 for b in window if b >= busy) / len(window)
        return {
            "mean_busy": round(sum(window) / len(window), 3),
            "saturated_share": round(share, 3),
            # marked when the cores were pegged for more than a quarter of the run: its times
            # include waiting for a CPU, not only for the network
            "saturated": share > 0.25,
            "samples": len(window),
        }


def storage_index(checkpoint: Path, storage_dir: Path) -> list[dict[str, Any]]:
    """Link the checkpoint's files into `storage_dir` with an index.json of names, sizes and sha256."""
    storage_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for path in sorted(checkpoint.iterdir()):
        if not path.is_file():
            continue
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(4 << 20), b""):
                digest.update(block)
        link = storage_dir / path.name
        if not link.exists():
            link.symlink_to(path.resolve())
        files.append({"name": path.name, "bytes": path.stat().st_size, "sha256": digest.hexdigest()})
    (storage_dir / "index.json").write_text(json.dumps({"files": files}))
    return files


@dataclass
class Hosts:
    """Starts and tracks the processes of one run on `network`, logs and JSON files in `workdir`."""

    network: Network
    workdir: Path
    verbose: bool = True
    procs: list[Proc] = field(default_factory=list)
    _n: int = 0

    @property
    def topology(self) -> Topology:
        return self.network.topology

    def address(self, host: str) -> str:
        return self.topology.host(host).address

    @property
    def planner_url(self) -> str:
        return f"http://{self.address('planner')}:{PLANNER_PORT}"

    @property
    def storage_url(self) -> str:
        return f"http://{self.address('storage')}:{STORAGE_PORT}"

    def env_for(self, host: str) -> dict[str, str]:
        """The environment of a process on `host`: its address for tcp, its labels, the checkout."""
        spec = self.topology.host(host)
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "RFORK_TCP_HOST": spec.address,
            "RFORK_NODE": host,
            "RFORK_RACK": "core" if spec.rack is None else f"rack{spec.rack}",
            "RFORK_ZONE": "zone0",
            # the harness talks only to processes it starts (as `rfork bench` does; see rfork.cli)
            "RFORK_ALLOW_UNENFORCED_ACCESS": "1",
        }
        paths = [str(CHECKOUT), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        return env

    def spawn(
        self,
        name: str,
        host: str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        stdin_pipe: bool = False,
        events_path: Path | None = None,
        json_path: Path | None = None,
    ) -> Proc:
        """Run `argv` on `host` (in its namespace), output to a log file in the workdir."""
        self._n += 1
        log_path = self.workdir / f"{self._n:02d}-{name}.log"
        cmd = [*self.network.exec_prefix(host), *argv]
        with log_path.open("wb") as out:
            started = time.time()
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                env={**self.env_for(host), **(env or {})},
                start_new_session=True,
            )
        p = Proc(
            name=name,
            host=host,
            proc=proc,
            log_path=log_path,
            started=started,
            events_path=events_path,
            json_path=json_path,
        )
        self.procs.append(p)
        log.info("started %s on %s (pid %d)", name, host, proc.pid)
        return p

    def rfork(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "rfork", *(["-v"] if self.verbose else []), *args]

    # --- the fixed hosts

    def start_planner(self, *, db: Path, env: dict[str, str] | None = None) -> Proc:
        """`rfork planner serve` on the planner host (SQLite `db`, no auth), its decisions logged."""
        argv = [
            sys.executable,
            "-m",
            "bench.fleet.planner_proc",
            "--db",
            f"sqlite:///{db}",
            "--host",
            self.address("planner"),
            "--port",
            str(PLANNER_PORT),
            "--insecure",
        ]
        p = self.spawn("planner", "planner", argv, env=env)
        self.wait_http(p, f"{self.planner_url}/healthz", timeout_s=60)
        return p

    def start_storage(self, checkpoint: Path) -> Proc:
        """An HTTP server with the checkpoint's files (stdlib http.server) on the storage host."""
        directory = self.workdir / "storage"
        storage_index(checkpoint, directory)
        argv = [
            sys.executable,
            "-m",
            "http.server",
            str(STORAGE_PORT),
            "--bind",
            self.address("storage"),
            "--directory",
            str(directory),
        ]
        p = self.spawn("storage", "storage", argv)
        self.wait_http(p, f"{self.storage_url}/index.json", timeout_s=30)
        return p

    def wait_http(self, p: Proc, url: str, *, timeout_s: float) -> None:
        """Poll `url` from inside the planner's namespace... from a client on the storage host's side:
        the root namespace has no route, so the probe runs `curl`-like Python inside `p`'s host."""
        deadline = time.monotonic() + timeout_s
        probe = [
            *self.network.exec_prefix(p.host),
            sys.executable,
            "-c",
            "import sys,urllib.request;urllib.request.urlopen(sys.argv[1],timeout=2)",
            url,
        ]
        while time.monotonic() < deadline:
            if p.proc.poll() is not None:
                raise HarnessError(f"{p.name} exited ({p.proc.returncode}):\n{p.tail()}")
            if subprocess.run(probe, capture_output=True, check=False, timeout=20).returncode == 0:
                return
            time.sleep(0.3)
        raise HarnessError(f"{p.name} not answering {url} within {timeout_s:.0f} s:\n{p.tail()}")

    def start_seed(
        self,
        host: str,
        checkpoint: Path,
        *,
        providers: Sequence[str] = ("tcp",),
        max_pulls: int = 2,
        timeout_s: float = 300,
    ) -> tuple[Proc, dict[str, Any]]:
        """`rfork seed` from the host's local checkpoint; waits for READY."""
        ready = self.workdir / f"seed-{host}.json"
        argv = self.rfork(
            "seed",
            "--checkpoint",
            str(checkpoint),
            "--planner",
            self.planner_url,
            "--provider",
            ",".join(providers),
            "--insecure",
            "--ready-file",
            str(ready),
            "--max-concurrent-pulls",
            str(max_pulls),
        )
        p = self.spawn(f"seed-{host}", host, argv, json_path=ready)
        return p, self.wait_json(p, ready, timeout_s=timeout_s)

    def wait_json(self, p: Proc, path: Path, *, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if path.exists():
                return dict(json.loads(path.read_text()))
            if p.proc.poll() is not None:
                raise HarnessError(f"{p.name} exited ({p.proc.returncode}) before {path.name}:\n{p.tail()}")
            time.sleep(0.05)
        raise HarnessError(f"{p.name}: no {path.name} within {timeout_s:.0f} s:\n{p.tail()}")

    # --- instances

    def start_instance(self, name: str, host: str, load_args: Sequence[str], *, fetch: bool = False) -> Proc:
        """An instance that imports, then waits for `go()`; `fetch`: download from storage first."""
        events = self.workdir / f"{name}.events.json"
        out = self.workdir / f"{name}.json"
        pre = ["--events", str(events)]
        if fetch:  # the download lands in the host's own directory, which `--checkpoint` then names
            into = str(self.workdir / "disks" / name)
            pre += ["--fetch", self.storage_url, "--into", into]
            load_args = [into if a == "FETCHED" else a for a in load_args]
        argv = [
            sys.executable,
            "-m",
            "bench.fleet.instance",
            *pre,
            "--",
            *(["-v"] if self.verbose else []),
            "load",
            "--json",
            str(out),
            "--no-progress",
            *load_args,
        ]
        return self.spawn(name, host, argv, stdin_pipe=True, events_path=events, json_path=out)

    def wait_imported(self, procs: Sequence[Proc], *, timeout_s: float = 300) -> None:
        """Until every instance has imported its libraries (its events file exists)."""
        deadline = time.monotonic() + timeout_s
        for p in procs:
            while not p.events().get("imported"):
                if p.proc.poll() is not None:
                    raise HarnessError(f"{p.name} exited ({p.proc.returncode}) during start-up:\n{p.tail()}")
                if time.monotonic() > deadline:
                    raise HarnessError(f"{p.name}: not started within {timeout_s:.0f} s:\n{p.tail()}")
                time.sleep(0.05)

    @staticmethod
    def go(procs: Sequence[Proc]) -> float:
        """The start signal to every instance at once; the time it was given."""
        t = time.time()
        for p in procs:
            if p.proc.stdin is not None:
                with contextlib.suppress(BrokenPipeError):
                    p.proc.stdin.write(b"g")
                    p.proc.stdin.flush()
        return t

    def kill(self, p: Proc) -> None:
        """SIGKILL `p` (and its session)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(timeout=10)

    def stop(self, p: Proc, *, grace_s: float = 5.0) -> None:
        """SIGTERM (a seed drains), SIGKILL after `grace_s`."""
        if p.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.proc.pid, signal.SIGTERM)
            try:
                p.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.kill(p)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.proc.pid, signal.SIGKILL)

    def close(self) -> None:
        """End every process started here (instances first, the planner last)."""
        for p in reversed(self.procs):
            if p.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    p.proc.stdin.close()
        for p in reversed(self.procs):
            if p.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.proc.pid, signal.SIGKILL)
        self.procs.clear()
