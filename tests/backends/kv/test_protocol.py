"""backends.kv: page-span planning (property tests) and the handshake/request protocol on real engines.

The cross-process end-to-end runs (prefill -> decode with the small Llama, two receivers, a killed
receiver) are in tests/rfork/test_kv_end_to_end.py; here both engines live in this process, which
is enough to check the protocol's answers to good and bad input.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends import TransferEngine, TransferTimeout
from backends.kv.transfer import (
    KvError,
    KvGeometry,
    KvPool,
    KvReceiver,
    KvSender,
    _parts,
    _runs,
    _unruns,
    imm_for,
    layer_spans,
)
from tests.backends.conftest import Peer, start_peer
from tests.backends.peer import engine_kwargs


@st.composite
def _mapping(draw: st.DrawFn) -> tuple[KvGeometry, list[int], KvGeometry, list[int], int]:
    layers = draw(st.integers(1, 4))
    page = draw(st.sampled_from([1, 8, 64]))
    sp_n, dp_n = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    n = draw(st.integers(0, min(sp_n, dp_n)))
    src = draw(st.permutations(range(sp_n)))[:n]
    dst = draw(st.permutations(range(dp_n)))[:n]
    if draw(st.booleans()):  # runs, as allocators often hand out
        src, dst = sorted(src), sorted(dst)
    layer = draw(st.integers(0, layers - 1))
    return KvGeometry(layers, sp_n, page), list(src), KvGeometry(layers, dp_n, page), list(dst), layer


@settings(max_examples=300, deadline=None)
@given(_mapping())
def test_layer_spans_move_exactly_the_mapped_pages(
    case: tuple[KvGeometry, list[int], KvGeometry, list[int], int],
) -> None:
    sg, sp, dg, dp, layer = case
    src = np.arange(sg.nbytes, dtype=np.int64)
    dst = np.full(dg.nbytes, -1, dtype=np.int64)
    spans = layer_spans(sg, sp, dg, dp, layer)
    for lo, ro, n in spans:
        assert n > 0
        dst[ro : ro + n] = src[lo : lo + n]
    want = np.full(dg.nbytes, -1, dtype=np.int64)
    for kv in (0, 1):
        for s, d in zip(sp, dp, strict=True):
            so, do = sg.offset(layer, kv, s), dg.offset(layer, kv, d)
            want[do : do + sg.page_bytes] = src[so : so + sg.page_bytes]
    assert np.array_equal(dst, want)
    if (
        sp == list(range(sp[0], sp[0] + len(sp))) and dp == list(range(dp[0], dp[0] + len(dp)))
        if sp
        else False
    ):
        assert len(spans) == 2  # one run per half when both sides are contiguous


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 100_000), max_size=3000))
def test_page_runs_round_trip_and_fit_in_small_messages(pages: list[int]) -> None:
    runs = _runs(pages)
    assert _unruns(runs) == pages
    parts = _parts(runs)
    assert [r for p in parts for r in p] == runs
    import json

    assert all(len(json.dumps(p)) < 3500 for p in parts)


def test_geometry_refuses_bad_shapes() -> None:
    with pytest.raises(ValueError, match="layers"):
        KvGeometry(0, 4, 16)
    with pytest.raises(ValueError, match="layers"):
        KvGeometry(5000, 4, 16)
    with pytest.raises(ValueError, match="positive"):
        KvGeometry(2, 0, 16)
    with pytest.raises(KvError, match="page id 9"):
        KvGeometry(2, 8, 16).check_pages([1, 9], "test")


@pytest.fixture
def pair(provider: str) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    kw = engine_kwargs(provider)
    with (
        TransferEngine(provider, 1, timeout_s=5.0, reorder_for_test=True, **kw) as a,
        TransferEngine(provider, 1, timeout_s=5.0, reorder_for_test=True, **kw) as b,
    ):
        yield a, b


@pytest.mark.timeout(120)
def test_protocol_good_and_bad_requests(pair: tuple[TransferEngine, TransferEngine]) -> None:
    a, b = pair
    page = 8192
    sender = KvSender(KvPool(a, layers=3, pages=4000, page_bytes=page))
    sp = sender.pool.buffer
    sp[:] = np.random.default_rng(1).integers(0, 256, sp.size, dtype=np.uint8)
    rpool = KvPool(b, layers=3, pages=3000, page_bytes=page)
    receiver = KvReceiver(rpool, name="dec-0", timeout_s=10)

    wrong = KvReceiver(
        KvPool(
            TransferEngine(a.provider, 1, **engine_kwargs(a.provider)), layers=2, pages=8, page_bytes=page
        ),
        timeout_s=10,
    )
    try:
        with pytest.raises(KvError, match="does not match"):
            wrong.join(sender.address)
    finally:
        wrong.engine.close()

    receiver.join(sender.address)
    assert sender.receivers() == ["dec-0"]

    # A long scattered page list travels in several small messages (shm stalls on large sends).
    n = 1200
    src = random.Random(2).sample(range(4000), n)
    dst = random.Random(3).sample(range(3000), n)
    inc = receiver.request(sender.address, "big", dst)
    sender.start("big", src).send_all().wait(30)
    inc.wait(10)
    g = sender.pool.geometry
    for layer in (0, 2):
        for kv in (0, 1):
            for s, d in list(zip(src, dst, strict=True))[::97]:
                so, do = g.offset(layer, kv, s), rpool.geometry.offset(layer, kv, d)
                assert np.array_equal(rpool.buffer[do : do + page], sp[so : so + page])

    # The sender starting first works too; out-of-range and mismatched page lists fail clearly.
    out = sender.start("late-want", [1, 2, 3])
    inc = receiver.request(sender.address, "late-want", [7, 8, 9])
    with pytest.raises(KvError, match="already pending"):
        receiver.request(sender.address, "late-want", [10])
    with pytest.raises(KvError, match="already being sent"):
        sender.start("late-want", [4])
    out.send_all().wait(30)
    inc.wait(10)
    with pytest.raises(KvError, match="page id 4000"):
        sender.start("bad-src", [4000])
    with pytest.raises(TransferTimeout, match="no receiver asked"):
        sender.start("lonely", [1]).send_all().wait(0.5)
    bad = sender.start("count", [1, 2, 3])
    inc = receiver.request(sender.address, "count", [5, 6])
    with pytest.raises(KvError, match="2 pages"):
        inc.wait(10)
    with pytest.raises(KvError, match="2 pages"):
        bad.wait(10)
    deadline = time.monotonic() + 5  # done-callbacks run just after the waiter woke
    while [w for w in b.imm._waiters if (w >> 12) & 0x7FFFF == inc.slot] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [w for w in b.imm._waiters if (w >> 12) & 0x7FFFF == inc.slot]  # failed: waiters withdrawn

    # Elastic: a receiver leaves (its pending request fails on the sender) and joins again.
    pending = sender.start("orphan", [10, 11])
    receiver.request(sender.address, "orphan", [20, 21])
    receiver.leave(sender.address)
    with pytest.raises(KvError, match="left"):
        pending.wait(10)
    assert sender.receivers() == []
    receiver.join(sender.address)
    inc = receiver.request(sender.address, "again", [30])
    sender.start("again", [31]).send_all().wait(30)
    inc.wait(10)


def test_imm_counter_discard_withdraws_only_that_waiter() -> None:
    from backends.imm import ImmCounter

    c = ImmCounter()
    a, b = c.expect(5, 1), c.expect(5, 1)
    assert c.discard(5, a) is True
    assert c.discard(5, a) is False
    c.arrive(5)
    assert b.done()
    assert not a.done()
    assert c.discard(6, b) is False


# ----- the receiver against a sender in another process that misbehaves or falls silent -----------
# The peer (tests/backends/peer.py) is no KvSender: it writes exactly the immediates a test names into
# the receiver's pool, in the order named, so arrival orders a real sender only hits by chance
# (issue #13) happen every run. SIGSTOP makes it silent down to the transport.


def _imms(slot: int, *layers: int) -> list[int]:
    return [imm_for(slot, layer) for layer in layers]


@pytest.fixture
def rx(provider: str) -> Iterator[KvReceiver]:
    """A receiver with two domains (two progress threads count immediates, as in production)."""
    with TransferEngine(provider, 2, timeout_s=5.0, reorder_for_test=True, **engine_kwargs(provider)) as eng:
        yield KvReceiver(KvPool(eng, layers=3, pages=8, page_bytes=64), name="rx", timeout_s=20.0)


@pytest.fixture
def raw_sender(provider: str) -> Iterator[Peer]:
    p = start_peer(provider, [("unused", 4096, "rw")])
    yield p
    with contextlib.suppress(ProcessLookupError):
        os.kill(_pid(p), signal.SIGCONT)
    p.stop()


def _pid(p: Peer) -> int:
    assert p.proc.pid is not None
    return p.proc.pid


def _until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def _timed_out_within(call: Callable[[], object], bound: float, slack: float = 3.0) -> str:
    """call() must raise TransferTimeout no earlier than bound and no later than bound + slack."""
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout) as err:
        call()
    took = time.monotonic() - t0
    assert bound * 0.9 <= took < bound + slack, f"timed out after {took:.2f}s, bound {bound}s"
    return str(err.value)


@pytest.mark.timeout(120)
def test_completion_counted_before_a_layer_does_not_complete_the_request(
    rx: KvReceiver, raw_sender: Peer
) -> None:
    """Issue #13: the completing immediate may be counted before the last layer's (two progress threads).

    Before the fix `done` resolved on the completion alone, so wait_layer(0) raised TransferTimeout at
    once ("did not arrive within 30s") and wait() returned with layer 0 not landed.
    """
    inc = rx.request(raw_sender.address, "early-done", [0, 1])
    desc = rx.pool.descriptor.to_bytes()
    assert raw_sender.call("write_imms", _imms(inc.slot, 0xFFF, 2, 1), desc) is True
    inc.wait_layer(2, 10)
    inc.wait_layer(1, 10)
    assert _until(lambda: inc._complete.done())  # the completion was counted here
    assert not inc.done.done()
    assert "layer 0 did not arrive" in _timed_out_within(lambda: inc.wait_layer(0, 1.0), 1.0)
    _timed_out_within(lambda: inc.wait(1.0), 1.0)
    assert raw_sender.call("write_imms", _imms(inc.slot, 0), desc) is True
    inc.wait_layer(0, 10)
    inc.wait(10)
    assert inc.done.result(0) is None


@pytest.mark.timeout(120)
def test_silent_sender_never_holds_a_wait_past_its_bound(rx: KvReceiver, raw_sender: Peer) -> None:
    """A sender that delivered part of a request and then stopped (SIGSTOP): every wait ends at its bound."""
    inc = rx.request(raw_sender.address, "half", [3])
    desc = rx.pool.descriptor.to_bytes()
    assert raw_sender.call("write_imms", _imms(inc.slot, 1), desc) is True
    inc.wait_layer(1, 10)
    os.kill(_pid(raw_sender), signal.SIGSTOP)
    for layer in (0, 2):
        _timed_out_within(functools.partial(inc.wait_layer, layer, 1.0), 1.0)
    _timed_out_within(lambda: inc.wait(1.0), 1.0)
    assert "did not answer" in _timed_out_within(lambda: rx.join(raw_sender.address, 1.0), 1.0)
    # The default bound is the receiver's timeout_s.
    rx.timeout_s = 1.5
    _timed_out_within(lambda: inc.wait_layer(0), 1.5)
    # The request is still alive: once the sender resumes, what it sends completes it.
    os.kill(_pid(raw_sender), signal.SIGCONT)
    assert raw_sender.call("write_imms", _imms(inc.slot, 2, 0, 0xFFF), desc) is True
    inc.wait(10)
