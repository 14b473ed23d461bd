"""Run seeds and loaders as real processes (for `rfork demo`, `rfork bench cold-start` and rfork's tests).

Every process started here is tracked by the `Fleet` and ended by `Fleet.close()` (SIGTERM, then
SIGKILL after a grace period), which callers put in a `finally` so Ctrl-C and errors clean up too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CHECKOUT = Path(__file__).resolve().parents[1]  # the repository root: bench/ is not installed


class HarnessError(RuntimeError):
    """A child process failed or did not get ready in time; the message carries its stderr tail."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(low: int = 10000, high: int = 21999) -> int:
    """A free port for a server that binds it only later (SGLang needs a number; it cannot take 0).

    Below the kernel's ephemeral range: a port from bind(0) stays free only until the kernel hands
    it to some outgoing connection (this test's /health polls, a seed's clients), and SGLang binds
    its HTTP port some 25 s after start, so such a port was taken now and then ("address already in
    use", exit 3). Also below 22000-29999, where SGLang picks its own nccl port the same way.
    """
    high = min(high, _ephemeral_low() - 1)
    for port in random.sample(range(low, high + 1), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise HarnessError(f"no free port in {low}-{high}")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    started: float  # time.time() just before spawning

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class Fleet:
    """Tracks child processes and their log files under `workdir`."""

    def __init__(self, workdir: Path, *, verbose: bool = False) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self.verbose = verbose
        self._n = 0

    def spawn(
        self,
        name: str,
        args: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        module: str | None = None,
    ) -> Child:
        """Start `python -m rfork ARGS` (or `python -m MODULE ARGS`), its output in the workdir."""
        self._n += 1
        log_path = self.workdir / f"{self._n:02d}-{name}.log"
        if module is None:
            cmd = [sys.executable, "-m", "rfork", *(["-v"] if self.verbose else []), *args]
        else:
            cmd = [sys.executable, "-m", module, *args]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if module is not None and module.split(".")[0] == "bench":
            # a module of bench/ is found through the checkout, whatever directory the caller ran in
            paths = [str(CHECKOUT), full_env.get("PYTHONPATH", "")]
            full_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        with log_path.open("wb") as out:
            started = time.time()
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                start_new_session=True,
            )
        child = Child(name=name, proc=proc, log_path=log_path, started=started)
        self.children.append(child)
        log.info("started %s (pid %d): %s", name, proc.pid, " ".join(cmd))
        return child

    def wait_file(self, child: Child, path: Path, *, timeout_s: float) -> dict[str, Any]:
        """Wait for `child` to write the JSON file `path`; HarnessError if it exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if path.exists():
                return dict(json.loads(path.read_text()))
            if child.proc.poll() is not None:
                raise HarnessError(
                    f"{child.name} exited with status {child.proc.returncode} before writing "
                    f"{path.name}:\n{child.tail()}"
                )
            time.sleep(0.05)
        raise HarnessError(
            f"{child.name} did not write {path.name} within {timeout_s:.0f} s:\n{child.tail()}"
        )

    def wait_exit(self, child: Child, *, timeout_s: float) -> int:
        try:
            return child.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise HarnessError(
                f"{child.name} still running after {timeout_s:.0f} s:\n{child.tail()}"
            ) from exc

    def stop(self, child: Child, *, grace_s: float = 10.0) -> int | None:
        """SIGTERM (the seed drains and deregisters), SIGKILL after `grace_s`."""
        if child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
            try:
                child.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM; killing", child.name, child.proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait(timeout=10)
        # children of the child (TP rank workers) share its session
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.proc.pid, signal.SIGKILL)
        return child.proc.returncode

    def kill(self, child: Child) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait(timeout=10)

    def close(self) -> None:
        for child in reversed(self.children):
            self.stop(child, grace_s=5.0)
        self.children.clear()


SETTLE_S = 3.0


def settle_memory(seconds: float) -> None:
    """Idle `seconds` before a measured process that loads into fresh memory.

    On a VM whose balloon reports free pages (virtio-balloon free page reporting, as on the dev VM),
    memory a process frees goes back to the host about 2 s later, and touching it again costs host
    page faults: 1-5 s per GiB against 0.1-0.4 s for memory freed a moment ago (docs/benchmarks.md,
    "Pull pipeline: first touch, the demo's shm row, pre-faulting"). Without a pause, whichever row
    follows a process that just exited gets the cheap memory; with one, every row starts from the same
    state.
    """
    if seconds > 0:
        time.sleep(seconds)


def seed_args(
    checkpoint: Path,
    planner_url: str,
    ready_file: Path,
    *,
    providers: Sequence[str] = ("tcp",),
    tp: int = 1,
    extra: Sequence[str] = (),
) -> list[str]:
    return [
        "seed",
        "--checkpoint",
        str(checkpoint),
        "--planner",
        planner_url,
        "--provider",
        ",".join(providers),
        "--tp",
        str(tp),
        "--insecure",
        "--ready-file",
        str(ready_file),
        *extra,
    ]


def load_args(
    json_file: Path,
    *,
    planner_url: str | None,
    checkpoint: Path | None = None,
    checkpoint_id: str | None = None,
    providers: Sequence[str] = ("tcp",),
    then: str = "exit",
    exclude: Sequence[str] = (),
    tp: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    out = [
        "load",
        "--json",
        str(json_file),
        *(["--no-serve"] if then == "exit" else []),
        "--no-progress",
        "--provider",
        ",".join(providers),
    ]
    if planner_url:
        out += ["--planner", planner_url, "--insecure"]
    if checkpoint is not None:
        out += ["--checkpoint", str(checkpoint)]
    if checkpoint_id is not None:
        out += ["--checkpoint-id", checkpoint_id]
    if tp is not None:
        out += ["--tp", str(tp)]
    for ex in exclude:
        out += ["--exclude", ex]
    return out + list(extra)


def available_providers(wanted: Sequence[str]) -> tuple[list[str], list[str]]:
    """(usable, skipped-with-reason) among `wanted` on this machine."""
    usable, skipped = [], []
    for p in wanted:
        if p == "shm":
            try:
                # imported here: `rfork bench --help` imports this module (start-up time)
                from backends.providers.libfabric import cma_permitted, provider_available

                ok = cma_permitted() and provider_available("shm")
            except Exception:  # noqa: BLE001 - a missing/broken binding just means "not here"
                ok = False
            if not ok:
                skipped.append("shm (CMA not permitted or provider missing)")
                continue
        usable.append(p)
    return usable, skipped


def recv_within(conn: Connection, timeout_s: float) -> Any:  # noqa: ANN401
    """The next message from a worker process, or TimeoutError after `timeout_s`."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"a bench process did not answer within {timeout_s:g}s")
    return conn.recv()


def stop_workers(procs: Sequence[tuple[BaseProcess, Connection]]) -> None:
    """Ask every worker process to exit, then join it (killing one that does not) and close its pipe."""
    for p, c in procs:
        if p.is_alive():
            with contextlib.suppress(OSError):
                c.send(("exit",))
    for p, c in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
        c.close()


def wait_healthy(child: Child, port: int, timeout_s: float) -> float:
    """Seconds from the child's start until `http://127.0.0.1:PORT/health` answers 200 (an engine's API
    server); HarnessError if it exits or is not ready in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise HarnessError(f"{child.name} exited:\n{child.tail(6000)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                if resp.status == 200:
                    return time.time() - child.started
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.2)
    raise HarnessError(f"{child.name} not ready in {timeout_s:.0f} s:\n{child.tail(6000)}")
