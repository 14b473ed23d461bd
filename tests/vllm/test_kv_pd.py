"""Prefill/decode disaggregation with rfork's KV connector between two real vLLM servers on CPU.

One prefill server (kv_producer) and one decode server (kv_consumer), started once for the module, side
by side; a toy proxy (tests/vllm/pd.py) sends each request to prefill, then to decode. The prefill
server also serves plain requests: those are the single-server reference (the connector does nothing
for a request without kv_transfer_params).
"""

from __future__ import annotations

import json
import re
import socket
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integrations.servers import free_port
from tests.vllm.pd import completion, disaggregated, prefill, tokens
from tests.vllm.servers import VLLM_CMD, ServerFleet, VllmServer, cpu_server_args

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

ABORT_TIMEOUT_S = 6.0  # how long prefill keeps blocks nobody collects (short, for the test)
NEW = 8
BLOCK = 32  # tokens per KV block: prompts span several blocks, and the decode server caches full ones
# prompts of different lengths (token ids of the tiny word tokenizer), across block boundaries
PROMPTS = [
    [5 + (i * 7) % 500 for i in range(n)] for n in (3, 16, 17, 40, 63, 90)
]


CHANNEL_KEY = "test-kv-channel-key-of-32-bytes!"


def kv_config(role: str) -> str:
    extra: dict[str, object] = {"provider": "tcp", "abort_timeout_s": ABORT_TIMEOUT_S, "timeout_s": 5}
    if role == "kv_consumer":
        extra["prefill_networks"] = ["127.0.0.0/8"]  # the servers' engines are on loopback (RFORK_TCP_HOST)
    return json.dumps({
        "kv_connector": "RforkKvConnector",
        "kv_connector_module_path": "rfork.integrations.vllm.kv_connector",
        "kv_role": role,
        "kv_connector_extra_config": extra,
        # a fetch that fails computes the prompt locally (vLLM's default policy fails the request)
        "kv_load_failure_policy": "recompute",
    })


@pytest.fixture(scope="module")
def pd(server_fleet: ServerFleet) -> tuple[VllmServer, VllmServer]:
    """The prefill and the decode server (the fleet stops them at the module's end)."""
    servers = []
    env = {**server_fleet.env, "RFORK_KV_CHANNEL_KEY": CHANNEL_KEY, "RFORK_TCP_HOST": "127.0.0.1"}
    for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        port = free_port()
        argv = [*VLLM_CMD, *cpu_server_args(server_fleet.model, port), "--block-size", str(BLOCK),
                "--kv-transfer-config", kv_config(role)]
        server = VllmServer(name, argv, port=port, log_path=server_fleet.workdir / f"{name}.log", env=env)
        server_fleet.servers.append(server)
        servers.append(server)
    for s in servers:
        s.wait_ready()
    return servers[0], servers[1]


def metric(server: VllmServer, name: str, labels: str = "") -> float:
    """One of vLLM's own Prometheus figures (the first series whose labels contain `labels`)."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    found = [float(v) for lab, v in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.e+-]+)$", text, re.M)
             if labels in lab]
    assert found, f"no {name}{{{labels}}} in /metrics"
    return found[0]


def kv_usage(server: VllmServer) -> float:
    """vLLM's gauge of KV cache blocks in use (0..1)."""
    return metric(server, "vllm:kv_cache_usage_perc")


def prompt_tokens(server: VllmServer, source: str) -> float:
    """Prompt tokens by where their KV came from: external_kv_transfer (received), local_cache_hit,
    local_compute."""
    return metric(server, "vllm:prompt_tokens_by_source_total", f'source="{source}"')


def wait_for(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.5)
    return bool(cond())


def test_disaggregated_outputs_equal_one_servers(pd: tuple[VllmServer, VllmServer]) -> None:
    p, d = pd
    reference = [tokens(completion(p.url, prompt, NEW)) for prompt in PROMPTS]
    sources = ("external_kv_transfer", "local_cache_hit", "local_compute")
    before = {s: prompt_tokens(d, s) for s in sources}
    for prompt, want in zip(PROMPTS, reference, strict=True):
        assert disaggregated(p.url, d.url, prompt, NEW) == want, f"prompt of {len(prompt)} tokens"
    moved = {s: prompt_tokens(d, s) - before[s] for s in sources}
    # the prompts share a prefix: the decode server had the full blocks of the shorter ones cached and
    # asked the prefill server only for the rest; no prompt token was computed on the decode server
    assert moved["local_cache_hit"] > 0, moved
    assert moved["external_kv_transfer"] + moved["local_cache_hit"] == sum(map(len, PROMPTS)), moved
    assert moved["local_compute"] == 0, moved
    # the same prompts again, concurrently
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda prompt: disaggregated(p.url, d.url, prompt, NEW), PROMPTS))
    assert got == reference
    assert "rfork KV connector: prefill (sender)" in p.log()
    assert "rfork KV connector: decode (receiver)" in d.log()
    assert "KV not received" not in d.log()
    assert "not delivered" not in p.log()
    assert wait_for(lambda: kv_usage(p) == 0.0, 30), "prefill kept blocks after every transfer"


def test_blocks_nobody_collects_are_freed_after_the_abort_timeout(pd: tuple[VllmServer, VllmServer]) -> None:
    """A decode server that never asks: prefill frees the request's blocks after abort_timeout_s."""
    p, _ = pd
    params = prefill(p.url, PROMPTS[-1])
    assert params["remote_block_ids"], params
    assert kv_usage(p) > 0.0, "the prefill server freed the blocks before anyone collected them"
    assert wait_for(lambda: kv_usage(p) == 0.0, ABORT_TIMEOUT_S + 30), "blocks leaked on the prefill server"
    assert "no decode server collected it" in p.log()


def test_a_prefill_server_that_is_gone_means_recompute_on_the_decode_server(
    pd: tuple[VllmServer, VllmServer],
) -> None:
    """The decode server is told to fetch from an engine that no longer exists (a prefill server that
    died after answering): the fetch fails within the connector's timeout, and vLLM's default
    kv_load_failure_policy (recompute) computes the prompt locally: the same tokens, no hang."""
    p, d = pd
    from backends import TransferEngine
    from rfork.integrations.vllm.kv_params import RemotePrefill

    with TransferEngine("tcp", 1, host="127.0.0.1") as gone:
        dead = gone.address
    prompt = PROMPTS[3]
    want = tokens(completion(p.url, prompt, NEW))
    block_size = prefill(p.url, prompt)["remote_block_size"]  # (prefill frees these after the timeout)
    params = RemotePrefill(dead, "never-prefilled", tuple(range(1, 9)), block_size).to_params()
    assert tokens(completion(d.url, prompt, NEW, params)) == want
    assert "vLLM's failure policy applies" in d.log()


def test_a_prefill_engine_outside_the_allow_list_is_refused_and_the_prompt_recomputed(
    pd: tuple[VllmServer, VllmServer],
) -> None:
    """A client's kv_transfer_params name an engine outside prefill_networks (10.9.8.7 here): the decode
    server sends it nothing, logs the refusal, recomputes the prompt (the same tokens) and serves on."""
    p, d = pd
    from backends.descriptor import EngineAddress
    from rfork.integrations.vllm.kv_params import RemotePrefill

    sockaddr = struct.pack("<H", socket.AF_INET) + struct.pack(">H", 4242) + bytes([10, 9, 8, 7]) + bytes(8)
    outside = EngineAddress("tcp", (sockaddr,)).to_bytes()
    prompt = PROMPTS[2]
    want = tokens(completion(p.url, prompt, NEW))
    params = RemotePrefill(outside, "someone-elses-request", tuple(range(1, 9)), BLOCK).to_params()
    assert tokens(completion(d.url, prompt, NEW, params)) == want
    assert "10.9.8.7 is outside prefill_networks; not joining it" in d.log()
    assert disaggregated(p.url, d.url, prompt, NEW) == want


def test_a_decode_request_aborted_while_its_kv_is_awaited_frees_its_blocks(
    pd: tuple[VllmServer, VllmServer],
) -> None:
    """The client gives up while the decode server waits for KV that will never come (the prefill
    server holds no such request): vLLM aborts the request, the worker cancels the fetch (the prefill
    server drops the want), and the blocks are freed once the transfer's quarantine passed."""
    p, d = pd
    prompt = PROMPTS[4]
    params = dict(prefill(p.url, prompt), remote_request_id="nobody-prefilled-this")
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        completion(d.url, prompt, NEW, params, timeout_s=3)
    assert wait_for(lambda: "vLLM aborted the request" in d.log(), 30), "the fetch was not cancelled"
    assert wait_for(lambda: kv_usage(d) == 0.0, 60), "the aborted request's blocks leaked"
    assert disaggregated(p.url, d.url, prompt, NEW) == tokens(completion(p.url, prompt, NEW))


def test_settings_the_connector_refuses_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_both, unknown settings, a decode server without prefill_networks and a server without the
    channel key (unless allow_keyless) fail at start-up with a message naming them (no server needed)."""
    from vllm.config import KVTransferConfig

    from rfork.integrations.vllm.kv_connector import ConnectorSettings
    from rfork.integrations.vllm.kv_worker import KvConnectorError

    class _Par:
        tensor_parallel_size = 1
        pipeline_parallel_size = 1

    class _Cfg:
        parallel_config = _Par()

        def __init__(self, kv: KVTransferConfig) -> None:
            self.kv_transfer_config = kv

    both = KVTransferConfig(kv_connector="RforkKvConnector", kv_role="kv_both")
    with pytest.raises(KvConnectorError, match="kv_producer .prefill. or kv_consumer"):
        ConnectorSettings.from_vllm(_Cfg(both))
    odd = KVTransferConfig(kv_connector="RforkKvConnector", kv_role="kv_consumer",
                           kv_connector_extra_config={"provder": "tcp"})
    with pytest.raises(KvConnectorError, match="provder"):
        ConnectorSettings.from_vllm(_Cfg(odd))
    monkeypatch.setenv("RFORK_KV_CHANNEL_KEY", CHANNEL_KEY)
    no_list = KVTransferConfig(kv_connector="RforkKvConnector", kv_role="kv_consumer")
    with pytest.raises(KvConnectorError, match="prefill_networks is not set"):
        ConnectorSettings.from_vllm(_Cfg(no_list))
    bad_list = KVTransferConfig(kv_connector="RforkKvConnector", kv_role="kv_consumer",
                                kv_connector_extra_config={"prefill_networks": ["10.0.0.0/33"]})
    with pytest.raises(KvConnectorError, match="prefill_networks"):
        ConnectorSettings.from_vllm(_Cfg(bad_list))
    monkeypatch.delenv("RFORK_KV_CHANNEL_KEY", raising=False)
    monkeypatch.delenv("RFORK_KV_CHANNEL_KEY_FILE", raising=False)
    keyless = KVTransferConfig(kv_connector="RforkKvConnector", kv_role="kv_producer")
    with pytest.raises(KvConnectorError, match="KEY_FILE. is not set"):
        ConnectorSettings.from_vllm(_Cfg(keyless))
    allowed = KVTransferConfig(kv_connector="RforkKvConnector", kv_role="kv_producer",
                               kv_connector_extra_config={"allow_keyless": True})
    assert ConnectorSettings.from_vllm(_Cfg(allowed)).channel_key is None
    _Par.tensor_parallel_size = 2
    ok = KVTransferConfig(kv_connector="RforkKvConnector", kv_role="kv_consumer")
    with pytest.raises(KvConnectorError, match="tensor_parallel_size 2"):
        ConnectorSettings.from_vllm(_Cfg(ok))
