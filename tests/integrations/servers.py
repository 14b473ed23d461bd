"""Framework servers (SGLang, vLLM) on CPU as real processes: what tests/sglang and tests/vllm share.

A server runs in its own session (so its whole process tree can be signalled) with its output in a
log file; each framework's module adds its command line, its generate call and its load-time figure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Generic, Self, TypeVar

from bench.processes import free_port

PROMPT = [1, 17, 42, 99, 256, 7, 311, 64]  # token ids (the tiny tokenizer's words w3..w511)
NEW_TOKENS = 12


class ServerError(RuntimeError):
    """A server exited or did not get ready; the message carries its log tail."""


__all__ = ["NEW_TOKENS", "PROMPT", "Fleet", "ServerError", "ServerProcess", "free_port"]


class ServerProcess:
    """One server process (its own session, so the whole tree can be signalled), ready at `/health`."""

    ready_timeout_s = 900.0  # a framework's module sets its own (and its variable to change it)
    tail_chars = 4000

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

    def tail(self, n: int | None = None) -> str:
        return self.log()[-(n or self.tail_chars):]

    def wait_ready(self, timeout_s: float | None = None) -> Self:
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
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
            time.sleep(0.25)  # a probe is one local connection: polling often costs nothing, waits less
        raise ServerError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def terminate(self) -> None:
        """SIGTERM to the launcher (the framework shuts down, the hook drains), once; does not wait."""
        if self.proc.poll() is None and not self._terminated:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, wait, then SIGKILL what is left of the process group."""
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
        """SIGKILL the whole server (launcher and workers): nothing gets to drain."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


S = TypeVar("S", bound=ServerProcess)


class Fleet(Generic[S]):
    """Starts servers of one kind, stops them all at the end."""

    def __init__(self, workdir: Path, model: Path, *, server_class: type[S], env: dict[str, str]) -> None:
        self.workdir = workdir
        self.model = model
        self.servers: list[S] = []
        self.env = env
        self._server_class = server_class

    def _start(self, name: str, argv: list[str], port: int) -> S:
        log_path = self.workdir / f"{name}.log"
        server = self._server_class(name, argv, port=port, log_path=log_path, env=self.env)
        self.servers.append(server)
        return server

    def close(self) -> None:
        # a graceful shutdown takes seconds (drain included): SIGTERM them all first, so that they
        # shut down side by side instead of one after another
        for s in self.servers:
            s.terminate()
        for s in reversed(self.servers):
            s.stop(timeout_s=30)
