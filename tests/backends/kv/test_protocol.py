"""backends.kv's handshake and requests on real engines: good and bad requests, and a receiver against
a sender in another process that misbehaves or falls silent.

The cross-process end-to-end runs (prefill -> decode with the small Llama, two receivers, a killed
receiver) are in tests/backends/kv/test_end_to_end.py.
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

from backends import TransferEngine, TransferTimeout
from backends.kv import IncomingRequest, KvError, KvPool, KvReceiver, KvSender
from tests.backends.conftest import Peer, skip_unless_pairs_within_process, start_peer
from tests.backends.kv.raw import welcome
from tests.backends.peer import engine_kwargs
from tests.backends.processes import stop_process
from tests.waiting import wait_until


@pytest.fixture
def pair(provider: str) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    skip_unless_pairs_within_process(provider)
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
    mine = {inc.layer_imm(layer) for layer in range(3)} | {inc.done_imm}
    # failed: waiters withdrawn (done-callbacks run just after the waiter woke)
    wait_until(lambda: not [w for w in b.imm._waiters if w in mine], 5, "the failed request's waiters gone")

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


# ----- the receiver against a sender in another process that misbehaves or falls silent -----------
# The peer (tests/backends/peer.py) is no KvSender: it writes exactly the immediates a test names into
# the receiver's pool, in the order named, so arrival orders a real sender only hits by chance
# (issue #13) happen every run. SIGSTOP makes it silent down to the transport.


DONE = -1  # stands for the completing immediate in _imms


def _imms(inc: IncomingRequest, *layers: int) -> list[int]:
    return [inc.done_imm if layer == DONE else inc.layer_imm(layer) for layer in layers]


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


BOUND = 0.5  # the waits' bound here: long enough to be sure nothing came, short enough to cost little


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
    welcome(rx, raw_sender)
    inc = rx.request(raw_sender.address, "early-done", [0, 1])
    desc = rx.pool.descriptor.to_bytes()
    assert raw_sender.call("write_imms", _imms(inc, DONE, 2, 1), desc) is True
    inc.wait_layer(2, 10)
    inc.wait_layer(1, 10)
    wait_until(inc._complete.done, 10, "the completion counted")
    assert not inc.done.done()
    assert "layer 0 did not arrive" in _timed_out_within(lambda: inc.wait_layer(0, BOUND), BOUND)
    _timed_out_within(lambda: inc.wait(BOUND), BOUND)
    assert raw_sender.call("write_imms", _imms(inc, 0), desc) is True
    inc.wait_layer(0, 10)
    inc.wait(10)
    assert inc.done.result(0) is None


@pytest.mark.timeout(120)
def test_silent_sender_never_holds_a_wait_past_its_bound(rx: KvReceiver, raw_sender: Peer) -> None:
    """A sender that delivered part of a request and then stopped (SIGSTOP): every wait ends at its bound."""
    welcome(rx, raw_sender)
    inc = rx.request(raw_sender.address, "half", [3])
    desc = rx.pool.descriptor.to_bytes()
    assert raw_sender.call("write_imms", _imms(inc, 1), desc) is True
    inc.wait_layer(1, 10)
    stop_process(_pid(raw_sender))
    for layer in (0, 2):
        _timed_out_within(functools.partial(inc.wait_layer, layer, BOUND), BOUND)
    _timed_out_within(lambda: inc.wait(BOUND), BOUND)
    assert "did not answer" in _timed_out_within(lambda: rx.join(raw_sender.address, BOUND), BOUND)
    # The default bound is the receiver's timeout_s.
    rx.timeout_s = 1.5 * BOUND
    _timed_out_within(lambda: inc.wait_layer(0), 1.5 * BOUND)
    # The request is still alive: once the sender resumes, what it sends completes it.
    os.kill(_pid(raw_sender), signal.SIGCONT)
    assert raw_sender.call("write_imms", _imms(inc, 2, 0, DONE), desc) is True
    inc.wait(10)
