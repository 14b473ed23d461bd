"""SGLang servers on CPU as real processes, for the tests and the load-time benchmark."""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.integrations.servers import NEW_TOKENS, PROMPT, Fleet, ServerError, ServerProcess, free_port

DOUBLES = Path(__file__).parent / "doubles"  # the test-only vllm._custom_ops stand-in


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


class SglangServer(ServerProcess):
    """One SGLang server process."""

    # a server start takes about a minute on 2 quiet cores, several on a shared, loaded box
    ready_timeout_s = float(os.environ.get("RFORK_SGLANG_READY_TIMEOUT_S", "900"))

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


class ServerFleet(Fleet[SglangServer]):
    """Starts SGLang servers (rfork-loaded ones through `rfork sglang`), stops them all at the end."""

    def __init__(self, workdir: Path, model: Path) -> None:
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(DOUBLES), str(Path.cwd()), os.environ.get("PYTHONPATH", "")]),
            "RFORK_TCP_HOST": "127.0.0.1",
        }
        env.pop("SGLANG_PLUGINS", None)
        super().__init__(workdir, model, server_class=SglangServer, env=env)

    def start_auto(self, name: str) -> SglangServer:
        port = free_port()
        argv = [sys.executable, "-m", "sglang.launch_server", *cpu_server_args(self.model, port),
                "--load-format", "auto"]
        return self._start(name, argv, port)

    def start_rfork(self, name: str, *, planner_url: str, mode: str = "checkpoint",
                    rfork_args: Sequence[str] = ()) -> SglangServer:
        port = free_port()
        argv = [sys.executable, "-m", "rfork", "sglang", "--planner", planner_url, "--insecure",
                "--mode", mode, "--timeout", "3", *rfork_args, "--", *cpu_server_args(self.model, port)]
        return self._start(name, argv, port)
