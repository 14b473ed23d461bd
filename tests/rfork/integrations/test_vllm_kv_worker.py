"""The vLLM connector's worker side without vLLM: two KvWorkers on CPU tensors shaped like vLLM's CPU
KV cache, over tcp in one process. Blocks move byte for byte; every offer and every fetch ends (sent,
failed or expired) and is reported once, so vLLM always gets its blocks back."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from rfork.integrations.vllm.kv_params import RemotePrefill
from rfork.integrations.vllm.kv_worker import KvConnectorError, KvWorker, cache_layout
from tests.waiting import wait_until

LAYERS, BLOCKS, HEADS, BLOCK, HEAD = 2, 16, 2, 32, 32


def caches(seed: int | None) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout: (blocks, kv_heads, block_size, 2 * head_size) per layer."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return {
        f"model.layers.{i}.self_attn.attn": (
            torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=gen).to(torch.bfloat16)
            if gen is not None else torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=torch.bfloat16)
        )
        for i in range(LAYERS)
    }


def until(cond: Callable[[], set[str]], timeout_s: float = 15.0) -> set[str]:
    """The first non-empty set `cond` reports (a bound for a loaded box, not a timing assertion)."""
    return wait_until(cond, timeout_s, f"{getattr(cond, '__qualname__', cond)} reported a request")


@pytest.fixture
def pair() -> Iterator[tuple[KvWorker, KvWorker, dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    src, dst = caches(1), caches(None)
    prefill = KvWorker(producer=True, kv_caches=src, timeout_s=2.0, abort_timeout_s=3.0)
    decode = KvWorker(producer=False, kv_caches=dst, timeout_s=2.0, abort_timeout_s=3.0)
    yield prefill, decode, src, dst
    decode.close()
    prefill.close()


def test_blocks_move_byte_for_byte_and_prefix_holders_get_the_tail(
    pair: tuple[KvWorker, KvWorker, dict[str, torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    prefill, decode, src, dst = pair
    prefill.send("r1", [3, 4, 9])
    decode.receive("d1", [0, 5, 6], RemotePrefill(prefill.address, "r1", (3, 4, 9), BLOCK))
    assert until(decode.finished_receiving) == {"d1"}
    assert until(prefill.finished_sending) == {"r1"}
    prefill.send("r2", [7, 8, 10])
    decode.receive("d2", [11, 12], RemotePrefill(prefill.address, "r2", (7, 8, 10), BLOCK))  # cached 1
    assert until(decode.finished_receiving) == {"d2"}
    assert until(prefill.finished_sending) == {"r2"}
    assert decode.take_failed_blocks() == set()
    for name in src:
        assert torch.equal(dst[name][[0, 5, 6]], src[name][[3, 4, 9]])
        assert torch.equal(dst[name][[11, 12]], src[name][[8, 10]])
        assert not dst[name][[1, 2, 3, 4, 7]].any()


def test_an_offer_nobody_collects_and_one_that_cannot_start_are_reported(
    pair: tuple[KvWorker, KvWorker, dict[str, torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    prefill, _, _, _ = pair
    prefill.send("lonely", [1])
    prefill.send("broken", [BLOCKS])  # a block id out of range: the offer cannot start, still reported
    assert prefill.finished_sending() == {"broken"}
    assert until(prefill.finished_sending, 10) == {"lonely"}  # after abort_timeout_s


def test_a_fetch_from_nowhere_fails_and_hands_its_blocks_back(
    pair: tuple[KvWorker, KvWorker, dict[str, torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    _, decode, _, _ = pair
    from backends import TransferEngine

    with TransferEngine("tcp", 1, host="127.0.0.1") as gone:
        dead = gone.address
    decode.receive("d1", [4, 5], RemotePrefill(dead, "r1", (1, 2), BLOCK))
    decode.receive("d2", [6, 7, 8], RemotePrefill(dead, "r2", (1,), BLOCK))  # more blocks than sent
    assert until(decode.finished_receiving) >= {"d2"}
    got = {"d2"} | until(decode.finished_receiving, 20)
    assert got == {"d1", "d2"}
    assert decode.take_failed_blocks() == {4, 5, 6, 7, 8}


def test_layouts_it_cannot_move_are_refused_by_name() -> None:
    bad = caches(None)
    bad["model.layers.1.self_attn.attn"] = torch.zeros(BLOCKS, HEADS, BLOCK, HEAD, dtype=torch.bfloat16)
    with pytest.raises(KvConnectorError, match="every layer alike"):
        cache_layout(bad)
    shared = caches(None)
    shared["model.layers.1.self_attn.attn"] = shared["model.layers.0.self_attn.attn"]
    with pytest.raises(KvConnectorError, match="shares its tensor"):
        cache_layout(shared)
    layout = cache_layout(caches(None))
    assert (layout.blocks, layout.halves, layout.block_bytes) == (BLOCKS, 1, HEADS * BLOCK * 2 * HEAD * 2)
