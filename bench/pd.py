"""Prefill/decode disaggregation with real vLLM servers: one server, P/D over rfork, P/D over NIXL.

The same prompts (distinct random token ids: no prefix-cache hits) go through (a) one vLLM server,
(b) a prefill and a decode server with rfork's KV connector, (c) the same with vLLM's NixlConnector
(UCX), one configuration at a time on this machine, each request as the toy proxy sends it
(tests/vllm/pd.py). Per mode: TTFT p50/p99 (request sent -> first token streamed from the server
that answers: for P/D the prefill's whole answer plus the decode's first token), requests/s at a
fixed concurrency, KV bytes per request, and the decode server's transfer time per request (rfork:
its per-request log line; NIXL: vLLM's `nixl_xfer_time_seconds`, when it exports it).

Runs from a checkout, in the vLLM venv (`.venv-vllm/bin/python -m rfork bench pd`): the servers are
`python -m vllm.entrypoints.openai.api_server` of this interpreter. The model defaults to a small
synthetic Llama written to a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import secrets
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    """Options: modes, prompts, concurrency, provider, model, JSON output."""
    parser.add_argument("--modes", default="single,rfork,nixl", help="comma-separated: single,rfork,nixl")
    parser.add_argument("--prompt-tokens", type=int, default=384,
                        help="tokens per prompt (default 384; the synthetic model takes up to 512 in all)")
    parser.add_argument("--requests", type=int, default=24, help="requests per mode (default 24)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    parser.add_argument("--provider", default="tcp", help="rfork's provider (default tcp)")
    parser.add_argument("--ucx-tls", default="tcp",
                        help="UCX_TLS for NIXL (default tcp; '' for UCX's choice)")
    parser.add_argument("--model", default=None, help="model directory (default: a synthetic Llama)")
    parser.add_argument("--json", dest="json_file", default=None, help="write the rows to this JSON file")


def _model(workdir: Path) -> Path:
    """A synthetic Llama big enough that KV moves megabytes: 8 layers, 8 KV heads x 64 dims, bf16."""
    # imported here: `rfork bench --help` imports every benchmark (start-up time)
    from rfork.weights.synthetic import LlamaConfig
    from tests.sglang.tiny_model import write_tiny_llama  # a checkout tool: the test model writer

    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=512)
    return write_tiny_llama(workdir / "model", config=config)


def _kv_config(connector: str, role: str, provider: str) -> str:
    if connector == "rfork":
        extra: dict[str, Any] = {"provider": provider}
        if role == "kv_consumer":  # the servers' engines are on loopback (RFORK_TCP_HOST below)
            extra["prefill_networks"] = ["127.0.0.0/8"]
        return json.dumps({"kv_connector": "RforkKvConnector",
                           "kv_connector_module_path": "rfork.integrations.vllm.kv_connector",
                           "kv_role": role, "kv_connector_extra_config": extra})
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"})


def _stream_first_token(
    url: str, prompt: Sequence[int], max_tokens: int, params: dict[str, Any] | None
) -> float:
    """Stream a completion; seconds until its first token arrived (the rest is read and dropped)."""
    body: dict[str, Any] = {"model": "tiny", "prompt": list(prompt), "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "stream": True}
    if params is not None:
        body["kv_transfer_params"] = params
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{url}: no token streamed")
    return first


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _drive(args: argparse.Namespace, prompts: list[list[int]], urls: tuple[str, ...]) -> dict[str, Any]:
    # imported here: `rfork bench --help` imports every benchmark (start-up time)
    from tests.vllm.pd import prefill

    def one(prompt: list[int]) -> float:
        t0 = time.perf_counter()
        if len(urls) == 1:
            return _stream_first_token(urls[0], prompt, args.max_tokens, None)
        params = prefill(urls[0], prompt)
        return time.perf_counter() - t0 + _stream_first_token(urls[1], prompt, args.max_tokens, params)

    one(prompts[0])  # warm-up (not counted): first requests pay one-off costs (joins, allocations)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        ttft = list(pool.map(one, prompts[1:]))
    wall = time.perf_counter() - t0
    return {"ttft_p50_ms": statistics.median(ttft) * 1e3, "ttft_p99_ms": _percentile(ttft, 0.99) * 1e3,
            "requests_per_s": len(ttft) / wall}


def _rfork_transfers(log_text: str) -> tuple[float, float]:
    """(mean KV bytes, mean ms) per request from the decode worker's log lines."""
    found = re.findall(r"blocks, (\d+) B received in ([0-9.]+) ms", log_text)
    rows = [(int(b), float(ms)) for b, ms in found]
    if not rows:
        return float("nan"), float("nan")
    return statistics.mean(b for b, _ in rows), statistics.mean(ms for _, ms in rows)


def _nixl_transfer_ms(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    s = re.findall(r"^vllm:nixl_xfer_time_seconds_sum\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
    c = re.findall(r"^vllm:nixl_xfer_time_seconds_count\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
    if not s or not c or float(c[0]) == 0:
        return float("nan")
    return float(s[0]) / float(c[0]) * 1e3


def run(args: argparse.Namespace) -> int:
    """Start each mode's servers, drive the prompts through them, print one row per mode."""
    import os

    # imported here: `rfork bench --help` imports every benchmark (start-up time)
    from tests.integrations.servers import free_port
    from tests.vllm.servers import VLLM_CMD, VllmServer, cpu_env, cpu_server_args

    channel_key = os.environ.get("RFORK_KV_CHANNEL_KEY") or secrets.token_hex(16)  # both servers share it
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 500) for _ in range(args.prompt_tokens)] for _ in range(args.requests + 1)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rfork-bench-pd-") as tmp:
        work = Path(tmp)
        model = Path(args.model) if args.model else _model(work)
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            servers: list[VllmServer] = []
            try:
                roles = [("single", None)] if mode == "single" else [("prefill", "kv_producer"),
                                                                      ("decode", "kv_consumer")]
                for name, role in roles:
                    port = free_port()
                    argv = [*VLLM_CMD, *cpu_server_args(model, port), "--block-size", "32"]
                    argv[argv.index("--max-model-len") + 1] = str(args.prompt_tokens + args.max_tokens + 32)
                    env = cpu_env()
                    env["VLLM_CPU_CI_ENV"] = "0"  # a benchmark: vLLM's normal CPU settings
                    env["RFORK_KV_CHANNEL_KEY"] = channel_key
                    env["RFORK_TCP_HOST"] = "127.0.0.1"
                    if role is not None:
                        argv += ["--kv-transfer-config", _kv_config(mode, role, args.provider)]
                        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
                        if args.ucx_tls:
                            env["UCX_TLS"] = args.ucx_tls
                    servers.append(VllmServer(f"{mode}-{name}", argv, port=port,
                                              log_path=work / f"{mode}-{name}.log", env=env))
                for s in servers:
                    s.wait_ready()
                row: dict[str, Any] = {"mode": mode, "prompt_tokens": args.prompt_tokens,
                                       "concurrency": args.concurrency, "requests": args.requests}
                row.update(_drive(args, prompts, tuple(s.url for s in servers)))
                if mode == "rfork":
                    row["kv_bytes"], row["transfer_ms"] = _rfork_transfers(servers[1].log())
                elif mode == "nixl":
                    row["transfer_ms"] = _nixl_transfer_ms(servers[1].url)
                rows.append(row)
                print(json.dumps(row), flush=True)  # noqa: T201 - the benchmark's output
            except Exception as exc:  # noqa: BLE001 - one mode failing (e.g. NIXL absent) leaves the others
                print(json.dumps({"mode": mode, "error": str(exc)[-800:]}), flush=True)  # noqa: T201
                log.warning("mode %s failed (server logs in %s)", mode, work)
            finally:
                for s in servers:
                    s.stop(timeout_s=30)
        print(f"load average: {os.getloadavg()}", flush=True)  # noqa: T201
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(rows, indent=1))
    return 0
