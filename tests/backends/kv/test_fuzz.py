"""A live KvSender and KvReceiver fed malformed and hostile messages (hypothesis) by a peer engine that
speaks the KV channel directly: no callback raises, nothing grows past its cap, nothing is written
outside a registered buffer, and an honest receiver is served afterwards."""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends import TransferEngine
from backends.channel import Channel
from backends.kv import KvPool, KvReceiver, KvSender
from backends.kv import messages as wire
from tests.backends.conftest import skip_unless_pairs_within_process
from tests.backends.peer import engine_kwargs
from tests.waiting import wait_until

LAYERS, PAGES, PAGE = 2, 16, 64


class Live:
    """A sender, an honest receiver joined to it, and a hostile engine with a raw "kv" channel."""

    def __init__(self, provider: str) -> None:
        kw = engine_kwargs(provider)
        self.engines = [TransferEngine(provider, 1, timeout_s=2.0, **kw) for _ in range(3)]
        a, b, h = self.engines
        self.sender = KvSender(KvPool(a, layers=LAYERS, pages=PAGES, page_bytes=PAGE))
        self.sender.pool.buffer[:] = np.arange(self.sender.pool.buffer.size, dtype=np.uint64).astype(np.uint8)
        rpool = KvPool(b, layers=LAYERS, pages=PAGES, page_bytes=PAGE)
        self.receiver = KvReceiver(rpool, timeout_s=5, slots=4)
        self.receiver.join(self.sender.address)
        self.hostile_pool = h.register(np.zeros(LAYERS * 2 * PAGES * PAGE, dtype=np.uint8), "rw")
        self.raw: Channel = h.channel(wire.CHANNEL, imms=4 * (LAYERS + 1))
        self.raw.on_message(lambda _m: None)
        self.served = 0

    def close(self) -> None:
        for e in self.engines:
            e.close()


@pytest.fixture(scope="module")
def live(provider: str) -> Iterator[Live]:
    skip_unless_pairs_within_process(provider)
    lv = Live(provider)
    yield lv
    lv.close()


_ends = itertools.count()
_ints = st.one_of(st.integers(-3, 40), st.integers(-(2**70), 2**70), st.just(10**10))
_json = st.recursive(
    st.none() | st.booleans() | _ints | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)
_runs = st.one_of(
    st.just([[0, 10**10]]),
    st.lists(st.lists(_ints, min_size=2, max_size=2), max_size=6),
    _json,
)


def _grant(live: Live) -> st.SearchStrategy[Any]:
    """Grant items: the right shape (regions naming the hostile's own memory), or anything."""
    d = live.hostile_pool.descriptor
    region = st.one_of(st.just([d.base, *d.keys]), st.lists(_ints, max_size=3), _json)
    item = st.tuples(_ints, _ints, st.lists(region, min_size=LAYERS * 2, max_size=LAYERS * 2)).map(list)
    return st.one_of(st.lists(item, max_size=3), st.lists(_json, max_size=3), _json)


@st.composite
def hostile_message(draw: st.DrawFn, live: Live) -> tuple[str, bytes]:
    kind = draw(st.sampled_from([wire.HELLO, wire.WANT, wire.CANCEL, wire.BYE, "junk", wire.FAILED]))
    if draw(st.booleans()) and kind != wire.HELLO:
        return kind, draw(st.binary(max_size=64))
    fields: dict[str, Any] = {}
    if kind == wire.HELLO:
        good = draw(st.booleans())
        fields = {
            "geometry": {"layers": LAYERS, "pages": PAGES, "page_bytes": PAGE} if good else draw(_json),
            "name": draw(st.text(max_size=8)),
            "imms": live.raw.imms.to_json() if draw(st.booleans()) else draw(_json),
        }
    elif kind in (wire.WANT, wire.CANCEL, wire.FAILED):
        fields = {
            "rid": draw(st.one_of(st.sampled_from(["r0", "r1", "x" * 300]), _json)),
            "slot": draw(_ints),
            "part": draw(_ints),
            "parts": draw(_ints),
            "pages": draw(_runs),
            "grant": draw(_grant(live)),
        }
    return kind, json.dumps(fields).encode()


def _honest_round(live: Live) -> None:
    rid = f"honest-{live.served}"
    live.served += 1
    inc = live.receiver.request(live.sender.address, rid, [3, 4])
    live.sender.start(rid, [5, 6]).send_all().wait(10)
    inc.wait(10)
    g = live.sender.pool.geometry
    src, dst = live.sender.pool.buffer, live.receiver.pool.buffer
    for layer in range(LAYERS):
        so, do = g.offset(layer, 1, 5), g.offset(layer, 1, 3)
        assert np.array_equal(dst[do : do + 2 * PAGE], src[so : so + 2 * PAGE])


@pytest.mark.timeout(300)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_kv_messages_never_raise_grow_or_stop_an_honest_receiver(
    live: Live, data: st.DataObject, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)  # the end markers below are logged as warnings
    messages = data.draw(st.lists(hostile_message(live), min_size=1, max_size=8))
    for kind, body in messages:
        live.raw.send(live.sender.address, kind, body).result(5)
        live.raw.send(live.receiver.engine.address, kind, body).result(5)
    # The channel delivers in order and its callbacks handle each message as it comes: a message of an
    # unknown kind sent last, logged when handled, marks the hostile ones before it handled.
    n = next(_ends)
    for to, marker in ((live.sender.address, f"end-s{n}"), (live.receiver.engine.address, f"end-r{n}")):
        live.raw.send(to, marker).result(5)

        def handled(m: str = marker) -> bool:
            return any(m in rec.getMessage() for rec in list(caplog.records))

        wait_until(handled, 10, f"the end marker {marker!r} is handled after the hostile messages")
    s = live.sender
    with s._lock:
        assert len(s._parts) + len(s._wants) <= 2 * 4 * 4  # each receiver's held state is capped by its slots
        assert all(r.held <= r.slots for r in s._receivers.values())
        # a grant names memory of the engine that sent it, never another's
        assert all(d.address == w.receiver for w in s._wants.values() for run in w.grant for d in run)
    assert len(live.receiver._requests) <= live.receiver.slots
    assert engine_errors(caplog) == []
    _honest_round(live)


def engine_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Errors logged by a callback that raised (what a hostile message must never cause)."""
    return [r.getMessage() for r in caplog.records if "raised" in r.getMessage()]
