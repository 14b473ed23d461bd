"""SGLang servers on CPU as real processes, for the tests and the load-time benchmark."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DOUBLES = Path(__file__).parent / "doubles"  # the test-only vllm._custom_ops stand-in
# a server start takes about a minute on 2 quiet cores, several on a shared, loaded box
READY_TIMEOUT_S = float(os.environ.get("RFORK_SGLANG_READY_TIMEOUT_S", "900"))
PROMPT = [1, 17, 42, 99, 256, 7, 311, 64]  # token ids (the tiny tokenizer's words w3..w511)
NEW_TOKENS = 12


class ServerError(RuntimeError):
    """An SGLang server exited or did not get ready; the message carries its log tail."""


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
    raise ServerError(f"no free port in {low}-{high}")


def cpu_server_args(model: Path, port: int) -> list[str]:
    """SGLang flags for a tiny model on a CPU-only machine (see ../shared/notes/sglang.md)."""
    return [
        "--model-path", str(model),
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--disable-cuda-graph",
        # SGLang on CPU sizes its pools from the host's free memory, which other processes move on a
        # shared box; the pool is capped by --max-total-tokens, so a large fraction costs nothing
        "--mem-fraction-static", "0.8",
        "--max-total-tokens", "2048",
        "--context-length", "256",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--random-seed", "0",
        "--skip-server-warmup",
        "--log-level", "info",
    ]


class SglangServer:
    """One SGLang server process (its own session, so the whole tree can be signalled)."""

    def __init__(self, name: str, argv: Sequence[str], *, port: int, log_path: Path, env: dict[str, str]):
        self.name = name
        self.port = port
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"
        self.started = time.monotonic()
        with log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )
        self.ready_s: float | None = None
        self._terminated = False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, n: int = 4000) -> str:
        return self.log()[-n:]

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> SglangServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp,
            ):
                if resp.status == 200:
                    self.ready_s = time.monotonic() - self.started
                    return self
            time.sleep(1.0)
        raise ServerError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def generate(self, input_ids: Sequence[int] = PROMPT, max_new_tokens: int = NEW_TOKENS) -> list[int]:
        body = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        }
        req = urllib.request.Request(
            f"{self.url}/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            out: dict[str, Any] = json.loads(resp.read())
        return [int(t) for t in out["output_ids"]]

    def weight_load_seconds(self) -> float:
        """SGLang's own figure: `Load weight end. elapsed=X s` (ModelRunner.load_model, whole)."""
        found = re.findall(r"Load weight end\. elapsed=([0-9.]+) s", self.log())
        if not found:
            raise ServerError(f"{self.name}: no 'Load weight end' line:\n{self.tail()}")
        return float(found[-1])

    def terminate(self) -> None:
        """SIGTERM to the launcher (SGLang shuts down, the hook drains), once; does not wait."""
        if self.proc.poll() is None and not self._terminated:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM to the launcher (SGLang shuts down, the hook drains), then SIGKILL what is left."""
        self.terminate()
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole server (launcher, schedulers): nothing gets to drain."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


class ServerFleet:
    """Starts servers (rfork-loaded ones through `rfork sglang`), stops them all at the end."""

    def __init__(self, workdir: Path, model: Path) -> None:
        self.workdir = workdir
        self.model = model
        self.servers: list[SglangServer] = []
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(DOUBLES), str(Path.cwd()), os.environ.get("PYTHONPATH", "")]),
            "RFORK_TCP_HOST": "127.0.0.1",
        }
        self.env.pop("SGLANG_PLUGINS", None)

    def start_auto(self, name: str) -> SglangServer:
        port = free_port()
        argv = [sys.executable, "-m", "sglang.launch_server", *cpu_server_args(self.model, port),
                "--load-format", "auto"]
        return self._start(name, argv, port)

    def start_rfork(self, name: str, *, planner_url: str, mode: str = "checkpoint",
                    rfork_args: Sequence[str] = ()) -> SglangServer:
        port = free_port()
        argv = [sys.executable, "-m", "rfork", "sglang", "--planner", planner_url, "--insecure-ok",
                "--mode", mode, "--timeout", "3", *rfork_args, "--", *cpu_server_args(self.model, port)]
        return self._start(name, argv, port)

    def _start(self, name: str, argv: list[str], port: int) -> SglangServer:
        server = SglangServer(name, argv, port=port, log_path=self.workdir / f"{name}.log", env=self.env)
        self.servers.append(server)
        return server

    def close(self) -> None:
        # a graceful SGLang shutdown takes about 6 s (drain included): SIGTERM them all first, so
        # that they shut down side by side instead of one after another
        for s in self.servers:
            s.terminate()
        for s in reversed(self.servers):
            s.stop(timeout_s=30)
