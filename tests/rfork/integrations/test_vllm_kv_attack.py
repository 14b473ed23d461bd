"""A hostile prefill engine (another process) against a decode KvWorker, the worker side of vLLM's connector
without vLLM. An API client names the prefill engine (`kv_transfer_params.rfork_address`), so:
- an engine outside the allow-list (`prefill_networks`, RFORK_SEED_NETWORKS) is sent nothing;
- an allowed engine without the channel key learns no descriptor;
- an allowed engine with the key reaches only the blocks granted for its own request, write-only, and only
  while that request is pending: neither another request's block nor, after a cancel, its own.
The hostile engine tries every descriptor it saw, stretched to any length, at the victim block.
"""

from __future__ import annotations

import base64
import dataclasses
import ipaddress
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from backends.descriptor import MemoryRegionDescriptor
from backends.providers.libfabric import refuses_forged_writes
from rfork.integrations.vllm.kv_params import RemotePrefill
from rfork.integrations.vllm.kv_worker import KvWorker
from tests.backends.conftest import Peer, start_peer
from tests.waiting import holds_for, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LAYERS, BLOCKS, BLOCK, HEAD = 2, 8, 4, 8  # float32, one KV head: 256 B blocks
BB = BLOCK * 2 * HEAD * 4
KEY = b"kv-attack-test-channel-key-32-by"
GRANTED = [2, 3]  # the hostile engine's own request lands here
VICTIM = 6  # a block of another request
LOOPBACK = [ipaddress.ip_network("127.0.0.0/8")]
SETTLE_S = 0.3  # a write that must not land: how long the test watches its target stay unchanged
WAIT_S = 20.0  # a bound for an event on a loaded box, not a timing assertion


def caches() -> dict[str, torch.Tensor]:
    """vLLM's CPU layout, (blocks, kv_heads, block_size, 2 * head_size) per layer, each block distinct."""
    return {
        f"model.layers.{i}.self_attn.attn": torch.arange(BLOCKS * BLOCK * 2 * HEAD, dtype=torch.float32)
        .add(1000 * i)
        .reshape(BLOCKS, 1, BLOCK, 2 * HEAD)
        for i in range(LAYERS)
    }


def block(cache: dict[str, torch.Tensor], b: int) -> list[bytes]:
    return [t[b].numpy().tobytes() for t in cache.values()]


@pytest.fixture(params=["tcp", "shm"])
def provider(request: pytest.FixtureRequest) -> str:
    """tcp; shm where the provider checks remote access (libfabric >= 2.5: RFORK_LIBFABRIC_LIB=mpich)."""
    name = str(request.param)
    if not refuses_forged_writes(name):
        pytest.skip(f"{name} on this libfabric does not enforce remote access: no grant confines a peer")
    return name


@pytest.fixture
def hostile(provider: str) -> Iterator[Peer]:
    regions = [("src", BLOCKS * BB, "rw"), ("dst", BLOCKS * BB, "rw")]
    p = start_peer(provider, regions, domains=1, reorder=False)
    yield p
    p.stop()


@pytest.fixture
def decode_worker(provider: str) -> Callable[..., tuple[KvWorker, dict[str, torch.Tensor]]]:
    """Makes a decode worker and its KV cache (the tensors vLLM would hold)."""

    def make(**kw: Any) -> tuple[KvWorker, dict[str, torch.Tensor]]:
        cache = caches()
        worker = KvWorker(
            producer=False, kv_caches=cache, provider=provider, timeout_s=2.0, abort_timeout_s=30.0, **kw
        )
        return worker, cache

    return make


Learned = list[tuple[MemoryRegionDescriptor, int]]


def learned(rx_address: bytes, messages: list[tuple[str, bytes, bytes]]) -> Learned:
    """Every descriptor the messages hand over, with the first block of the layer each one starts at."""
    out: Learned = []
    for kind, data, _ in messages:
        fields = json.loads(data) if data else {}
        for d in [*([fields["desc"]] if "desc" in fields else []), *fields.get("descs", [])]:
            out.append((MemoryRegionDescriptor.from_bytes(base64.b64decode(d)), 0))
        for start, count, regions in fields.get("grant", []) if kind == "want" else []:
            for e in regions:
                desc = MemoryRegionDescriptor(rx_address, tuple(e[1:]), e[0], count * BB, "write")
                out.append((desc, start))
    return out


def attack(hostile: Peer, descs: Learned, target: int, cache: dict[str, torch.Tensor]) -> int:
    """Write block `target` (the hostile's "src" bytes) and read it through every descriptor, each
    stretched to 1 TiB and made readable; returns how many reads brought back the block's bytes.

    Whether a write landed shows in the cache. The provider refuses such ops (tcp) or completes them
    without touching memory outside the region (shm on libfabric 2.5): the test checks the effect.
    shm 2.5 may land a write after it completed: callers wait for what must land, and give what
    must not a moment (SETTLE_S) before checking.
    """
    leaked = 0
    for desc, first in descs:
        forged = dataclasses.replace(desc, length=1 << 40, access="rw").to_bytes()
        off = (target - first) * BB
        before = block(cache, target)
        hostile.call("write", "src", 0, BB, forged, off, None)
        got = hostile.call("read", "dst", 0, BB, forged, off)
        leaked += isinstance(got, bytes) and got in before + block(cache, target)
    return leaked


def welcome(hostile: Peer, rx: KvWorker, timeout_s: float = 10.0) -> list[tuple[str, bytes, bytes]]:
    """Answer the decode worker's hello as a prefill engine would; then what it sent (hello, want)."""
    hello = hostile.call("inbox", "kv", 1, timeout_s)
    assert [k for k, _, _ in hello] == ["hello"]
    layers = json.dumps({"layers": LAYERS}).encode()
    assert hostile.call("send", rx.address, "kv", "welcome", layers) is True
    return list(hostile.call("inbox", "kv", 2, timeout_s))


def test_an_allowed_prefill_engine_reaches_only_its_grant_and_only_while_its_request_is_pending(
    hostile: Peer, decode_worker: Callable[..., tuple[KvWorker, dict[str, torch.Tensor]]]
) -> None:
    rx, cache = decode_worker(channel_key=KEY, prefill_networks=LOOPBACK)
    try:
        victim = block(cache, VICTIM)
        assert hostile.call("key", "kv", KEY) is True
        rx.receive("r1", GRANTED, RemotePrefill(hostile.address, "r1", (0, 1), BLOCK))
        messages = welcome(hostile, rx)
        assert [k for k, _, _ in messages] == ["hello", "want"]
        descs = learned(rx.address, messages)
        assert descs, "the want must grant the request's blocks"

        # what the engine is there for: its request's own blocks take its writes
        assert hostile.call("fill", "src", 7) is True
        attack(hostile, descs, GRANTED[0], cache)
        fresh = block(caches(), GRANTED[0])
        wait_until(lambda: block(cache, GRANTED[0]) != fresh, WAIT_S, "the granted block written")

        # another request's block: neither written nor read, whatever length the descriptor claims
        assert attack(hostile, descs, VICTIM, cache) == 0
        # a write already posted could still land: watch the block for a while
        holds_for(lambda: block(cache, VICTIM) == victim, SETTLE_S, "the victim's block unchanged")

        # vLLM aborts the request: the grant is gone, its own blocks are out of reach too
        rx.cancel({"r1"})
        started = rx._receiving["r1"].started.result(10)
        wait_until(started.done.done, WAIT_S, "the aborted request's transfer done")
        landed = block(cache, GRANTED[0])
        assert hostile.call("fill", "src", 8) is True
        assert attack(hostile, descs, GRANTED[0], cache) == 0
        holds_for(lambda: block(cache, GRANTED[0]) == landed, SETTLE_S, "the revoked block unchanged")
    finally:
        rx.close()


def test_a_prefill_engine_without_the_channel_key_learns_no_descriptor(
    hostile: Peer, decode_worker: Callable[..., tuple[KvWorker, dict[str, torch.Tensor]]]
) -> None:
    rx, _ = decode_worker(channel_key=KEY, prefill_networks=LOOPBACK)
    try:
        assert hostile.call("watch") is True  # it reads every frame it gets, key or not
        rx.receive("r1", GRANTED, RemotePrefill(hostile.address, "r1", (0, 1), BLOCK))
        seen = wait_until(lambda: hostile.call("opened"), WAIT_S, "the hostile engine opened a frame")
        assert [k for _, k, _ in seen] == ["hello"]
        # it answers without the key: the decode side drops that welcome, so no want (no grant) follows
        layers = json.dumps({"layers": LAYERS}).encode()
        assert hostile.call("send", rx.address, "kv", "welcome", layers) is True
        assert wait_until(rx.finished_receiving, WAIT_S, "r1 reported finished") == {"r1"}
        assert rx.take_failed_blocks() == set(GRANTED)
        seen = hostile.call("opened")
        assert "want" not in [k for _, k, _ in seen]
        assert learned(rx.address, [(k, d, b"") for _, k, d in seen]) == []
        for _, _, data in seen:
            assert not {"desc", "descs", "grant"} & set(json.loads(data))
    finally:
        rx.close()


@pytest.mark.parametrize("where", ["prefill_networks", "RFORK_SEED_NETWORKS"])
def test_a_prefill_engine_outside_the_allow_list_is_sent_nothing(
    hostile: Peer,
    decode_worker: Callable[..., tuple[KvWorker, dict[str, torch.Tensor]]],
    where: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if where == "prefill_networks":
        rx, _ = decode_worker(channel_key=KEY, prefill_networks=[ipaddress.ip_network("10.0.0.0/8")])
    else:
        monkeypatch.setenv("RFORK_SEED_NETWORKS", "10.0.0.0/8")
        rx, _ = decode_worker(channel_key=KEY)
    try:
        assert hostile.call("watch") is True
        rx.receive("r1", GRANTED, RemotePrefill(hostile.address, "r1", (0, 1), BLOCK))
        assert wait_until(rx.finished_receiving, WAIT_S, "r1 reported finished") == {"r1"}
        assert rx.take_failed_blocks() == set(GRANTED)
        assert rx.finished_receiving() == set()  # reported once
        # a frame already on its way would arrive within this window
        holds_for(lambda: hostile.call("opened") == [], SETTLE_S, "nothing sent outside", every_s=0.05)
    finally:
        rx.close()

