"""Pools with one region per layer (how vLLM allocates its cache): a request moves byte for byte between
a per-layer pool and a whole pool, in both directions, and a want whose grant does not fit its pages
is refused."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from backends import TransferEngine
from backends.kv import KvError, KvPool, KvReceiver, KvSender
from tests.backends.conftest import skip_unless_pairs_within_process
from tests.backends.peer import engine_kwargs

LAYERS, PAGES, PAGE = 3, 8, 64
LAYER_BYTES = 2 * PAGES * PAGE


@pytest.fixture
def engines(provider: str) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    skip_unless_pairs_within_process(provider)
    kw = engine_kwargs(provider)
    with TransferEngine(provider, 1, timeout_s=5.0, **kw) as a, TransferEngine(
        provider, 1, timeout_s=5.0, **kw
    ) as b:
        yield a, b


def _pool(eng: TransferEngine, layer_buffers: list[np.ndarray] | None, whole: np.ndarray | None) -> KvPool:
    return KvPool(eng, layers=LAYERS, pages=PAGES, page_bytes=PAGE, buffer=whole, layer_buffers=layer_buffers)


@pytest.mark.parametrize(("src_per_layer", "dst_per_layer"), [(True, False), (False, True), (True, True)])
def test_request_moves_between_per_layer_and_whole_pools(
    engines: tuple[TransferEngine, TransferEngine], src_per_layer: bool, dst_per_layer: bool
) -> None:
    a, b = engines
    src_bufs = [np.random.default_rng(i).integers(0, 255, LAYER_BYTES, dtype=np.uint8) for i in range(LAYERS)]
    dst_bufs = [np.zeros(LAYER_BYTES, np.uint8) for _ in range(LAYERS)]
    src_whole, dst_whole = np.concatenate(src_bufs), np.zeros(LAYERS * 2 * PAGES * PAGE, np.uint8)
    src = _pool(a, src_bufs if src_per_layer else None, None if src_per_layer else src_whole)
    dst = _pool(b, dst_bufs if dst_per_layer else None, None if dst_per_layer else dst_whole)
    sender, receiver = KvSender(src), KvReceiver(dst, name="per-layer")
    receiver.join(sender.address)
    src_pages, dst_pages = [5, 1, 2, 3], [0, 6, 7, 2]
    inc = receiver.request(sender.address, "r1", dst_pages)
    sender.start("r1", src_pages).send_all().wait(10)
    inc.wait(10)

    def layer_of(bufs: list[np.ndarray], whole: np.ndarray, per_layer: bool, layer: int) -> np.ndarray:
        n = LAYER_BYTES
        return bufs[layer] if per_layer else whole[layer * n : (layer + 1) * n]

    for layer in range(LAYERS):
        s = layer_of(src_bufs, src_whole, src_per_layer, layer).reshape(2, PAGES, PAGE)
        d = layer_of(dst_bufs, dst_whole, dst_per_layer, layer).reshape(2, PAGES, PAGE)
        want = np.zeros_like(d)
        want[:, dst_pages] = s[:, src_pages]
        assert np.array_equal(d, want), f"layer {layer}"
    sender.close()
    receiver.close()


def test_per_layer_pool_checks_its_buffers(engines: tuple[TransferEngine, TransferEngine]) -> None:
    a, _ = engines
    with pytest.raises(ValueError, match="2 layer buffers for 3 layers"):
        KvPool(a, layers=3, pages=PAGES, page_bytes=PAGE, layer_buffers=[np.zeros(LAYER_BYTES, np.uint8)] * 2)
    bufs = [np.zeros(LAYER_BYTES, np.uint8), np.zeros(10, np.uint8), np.zeros(LAYER_BYTES, np.uint8)]
    with pytest.raises(ValueError, match="layer 1 buffer has"):
        KvPool(a, layers=3, pages=PAGES, page_bytes=PAGE, layer_buffers=bufs)


@pytest.mark.parametrize(
    ("tamper", "refusal"),
    [
        (lambda items: [[s, c, r[1:]] for s, c, r in items], "lists 6 regions"),  # a layer's half missing
        (lambda items: [[s, c - 1, r] for s, c, r in items], "page 2 is not granted"),  # a page outside
        (lambda items: [[s, c, r] for s, c, r in items] * 2, "out of order or overlap"),
    ],
)
def test_a_want_whose_grant_does_not_fit_its_pages_is_refused(
    engines: tuple[TransferEngine, TransferEngine],
    tamper: Callable[[list[list[Any]]], list[list[Any]]],
    refusal: str,
) -> None:
    a, b = engines
    sender = KvSender(KvPool(a, layers=LAYERS, pages=PAGES, page_bytes=PAGE))
    dst = KvPool(b, layers=LAYERS, pages=PAGES, page_bytes=PAGE,
                 layer_buffers=[np.zeros(LAYER_BYTES, np.uint8) for _ in range(LAYERS)])
    receiver = KvReceiver(dst)
    receiver.join(sender.address)
    grant = receiver._grant
    receiver._grant = lambda req, pages: tamper(grant(req, pages))  # type: ignore[method-assign]
    inc = receiver.request(sender.address, "tampered", [1, 2])
    with pytest.raises(KvError, match=refusal):
        inc.wait(10)
    assert inc.grants == []  # the failed request's regions were closed
    sender.close()
    receiver.close()


def test_a_receiver_holding_a_prefix_gets_the_last_pages_when_the_sender_allows_it(
    engines: tuple[TransferEngine, TransferEngine],
) -> None:
    """vLLM's decode server may have the prompt's first blocks cached: it asks for the rest only."""
    a, b = engines
    src_bufs = [np.random.default_rng(i).integers(0, 255, LAYER_BYTES, dtype=np.uint8) for i in range(LAYERS)]
    dst_bufs = [np.zeros(LAYER_BYTES, np.uint8) for _ in range(LAYERS)]
    sender, receiver = KvSender(_pool(a, src_bufs, None)), KvReceiver(_pool(b, dst_bufs, None))
    receiver.join(sender.address)
    inc = receiver.request(sender.address, "tail", [6, 7])
    sender.start("tail", [0, 1, 2, 3], suffix_ok=True).send_all().wait(10)
    inc.wait(10)
    for layer in range(LAYERS):
        s, d = src_bufs[layer].reshape(2, PAGES, PAGE), dst_bufs[layer].reshape(2, PAGES, PAGE)
        assert np.array_equal(d[:, [6, 7]], s[:, [2, 3]])
    strict = receiver.request(sender.address, "strict", [6, 7])
    with pytest.raises(KvError, match="asked for 2 pages, the sender has 4"):
        sender.start("strict", [0, 1, 2, 3]).send_all().wait(10)
    with pytest.raises(KvError):
        strict.wait(10)
    sender.close()
    receiver.close()


def test_pages_that_hold_k_and_v_together_move_whole(engines: tuple[TransferEngine, TransferEngine]) -> None:
    """halves=1 (vLLM's CPU cache: a block holds its K and V): a page moves as one piece; a receiver
    whose pages are split in halves is refused at join."""
    a, b = engines
    page = 2 * PAGE
    rng = np.random.default_rng(9)
    src_bufs = [rng.integers(0, 255, PAGES * page, dtype=np.uint8) for _ in range(LAYERS)]
    dst_bufs = [np.zeros(PAGES * page, np.uint8) for _ in range(LAYERS)]
    src = KvPool(a, layers=LAYERS, pages=PAGES, page_bytes=page, halves=1, layer_buffers=src_bufs)
    dst = KvPool(b, layers=LAYERS, pages=PAGES, page_bytes=page, halves=1, layer_buffers=dst_bufs)
    sender, receiver = KvSender(src), KvReceiver(dst)
    receiver.join(sender.address)
    inc = receiver.request(sender.address, "whole", [3, 4, 0])
    sender.start("whole", [7, 1, 2]).send_all().wait(10)
    inc.wait(10)
    for layer in range(LAYERS):
        s, d = src_bufs[layer].reshape(PAGES, page), dst_bufs[layer].reshape(PAGES, page)
        assert np.array_equal(d[[3, 4, 0]], s[[7, 1, 2]])
        assert not d[[1, 2, 5, 6, 7]].any()
    receiver.close()
    halves = KvReceiver(KvPool(b, layers=LAYERS, pages=PAGES, page_bytes=page))
    with pytest.raises(KvError, match="2 halves"):
        halves.join(sender.address)
    halves.close()
    sender.close()


def test_a_want_for_a_request_the_sender_gave_up_on_is_refused_at_once(
    engines: tuple[TransferEngine, TransferEngine],
) -> None:
    """A decode server that asks after the prefill server stopped waiting (abort) learns it at once,
    instead of after want_ttl_s."""
    a, b = engines
    sender = KvSender(KvPool(a, layers=LAYERS, pages=PAGES, page_bytes=PAGE), want_ttl_s=300)
    receiver = KvReceiver(KvPool(b, layers=LAYERS, pages=PAGES, page_bytes=PAGE))
    receiver.join(sender.address)
    out = sender.start("late", [1, 2])
    out.abort("nobody collected it")
    with pytest.raises(KvError, match="nobody collected it"):
        out.wait(1)
    inc = receiver.request(sender.address, "late", [3, 4])
    with pytest.raises(KvError, match="sender refused: .*nobody collected it"):
        inc.wait(5)
    sender.close()
    receiver.close()
