"""Channels: paths sharing one engine never see each other's messages or immediates (across two real
processes), early messages wait for their channel, immediate ranges are disjoint and run out clearly,
and nothing a peer sends makes the frame decoder raise or hold state (hypothesis)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends import ChannelError, EngineAddress, ImmRange, Message, TransferEngine
from backends.channel import EARLY_LIMIT, EARLY_PER_SENDER, IMM_FIRST, ChannelHub
from backends.imm import ImmCounter
from tests.backends.conftest import Peer, start_peer
from tests.backends.peer import engine_kwargs
from tests.waiting import holds_for, wait_until


@pytest.fixture(scope="module")
def peer(provider: str) -> Iterator[Peer]:
    """A peer process with one small region (our immediates do not need more)."""
    p = start_peer(provider, [("small", 1 << 20, "rw")])
    yield p
    p.stop()


@pytest.fixture
def engine(provider: str) -> Iterator[TransferEngine]:
    with TransferEngine(provider, 2, timeout_s=8.0, reorder_for_test=True, **engine_kwargs(provider)) as eng:
        yield eng


class Inbox:
    """A channel callback that keeps what arrives and can wait for it."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self._cond = threading.Condition()

    def __call__(self, message: Message) -> None:
        with self._cond:
            self.messages.append(message)
            self._cond.notify_all()

    def wait(self, count: int, timeout: float = 10.0) -> list[Message]:
        with self._cond:
            self._cond.wait_for(lambda: len(self.messages) >= count, timeout)
            return list(self.messages)


@pytest.mark.timeout(60)
def test_two_paths_on_one_engine_never_see_each_others_traffic(engine: TransferEngine, peer: Peer) -> None:
    a, b = engine.channel("path-a", imms=4), engine.channel("path-b", imms=4)
    assert a.imms.base + a.imms.count <= b.imms.base or b.imms.base + b.imms.count <= a.imms.base
    got_a, got_b = Inbox(), Inbox()
    a.on_message(got_a)
    b.on_message(got_b)
    region = engine.register(np.zeros(4096, dtype=np.uint8), "rw")
    desc = region.descriptor.to_bytes()
    # the peer's two paths talk to ours, interleaved; and signal only path a, on index 0 and 3
    for i in range(3):
        assert peer.call("send", engine.address, "path-a", "to-a", bytes([i])) is True
        assert peer.call("send", engine.address, "path-b", "to-b", bytes([10 + i])) is True
    assert peer.call("write_imms", [a.imm(0), a.imm(0), a.imm(3)], desc) is True
    assert [(m.kind, m.data) for m in got_a.wait(3)] == [("to-a", bytes([i])) for i in range(3)]
    assert [(m.kind, m.data) for m in got_b.wait(3)] == [("to-b", bytes([10 + i])) for i in range(3)]
    assert {m.sender for m in got_a.messages + got_b.messages} == {peer.address}
    a.expect(0, 2).result(10)
    a.expect(3).result(10)
    late = b.expect(0)  # the same index on b is another value: nothing arrived for it
    holds_for(lambda: not late.done(), 0.2, "b's index 0 unsignalled")  # a's signals would show here
    assert all(engine.imm.pending(b.imm(i)) == 0 for i in range(4))
    # and the other way: each of the peer's channels gets only what our channel of its name sent
    a.send(peer.address, "from-a", b"x").result(10)
    b.send_json(peer.address, "from-b", n=1).result(10)
    assert [(k, d) for k, d, _ in peer.call("inbox", "path-a", 1, 10)] == [("from-a", b"x")]
    assert [(k, d) for k, d, _ in peer.call("inbox", "path-b", 1, 10)] == [("from-b", b'{"n":1}')]
    assert {s for _, _, s in peer.call("inbox", "path-b", 1, 0)} == {engine.address}
    # the peer's engine allocates its channels' immediates: signalling index 0 of one is not the other's
    pa = ImmRange.from_json(peer.call("channel", "imm-a", 2))
    pb = ImmRange.from_json(peer.call("channel", "imm-b", 2))
    assert peer.call("expect", "pa", pa.value(0), 1) is True
    assert peer.call("expect", "pb", pb.value(0), 1) is True
    engine.write_imm(pa.value(0), peer.descs["small"]).result(10)
    assert peer.call("wait_expect", "pa", 10) is True
    assert peer.call("wait_expect", "pb", 0.3) is False
    a.close()
    b.close()


@pytest.mark.timeout(60)
def test_messages_before_the_channel_opens_wait_for_it(engine: TransferEngine, peer: Peer) -> None:
    for i in range(5):
        assert peer.call("send", engine.address, "later", "early", bytes([i])) is True
    wait_until(lambda: engine._hub().early() == 5, 10, "five early frames held")
    channel = engine.channel("later")
    assert peer.call("send", engine.address, "later", "early", bytes([5])) is True
    wait_until(lambda: engine._hub().early() == 6, 10, "open but with no callback yet: still kept")
    inbox = Inbox()
    channel.on_message(inbox)  # everything so far arrives now, in order
    assert peer.call("send", engine.address, "later", "live", b"") is True
    got = inbox.wait(7)
    assert [m.data for m in got[:6]] == [bytes([i]) for i in range(6)]
    assert got[6].kind == "live"
    assert engine._hub().early() == 0
    channel.close()
    # a closed channel drops what still comes for it, and counts it
    before = engine.frames_dropped["closed"]
    assert peer.call("send", engine.address, "later", "too-late", b"") is True
    wait_until(lambda: engine.frames_dropped["closed"] == before + 1, 10, "the late frame dropped as closed")
    assert engine._hub().early() == 0


@pytest.mark.timeout(60)
def test_malformed_frames_are_dropped_and_counted_and_the_channel_still_works(
    engine: TransferEngine, peer: Peer
) -> None:
    inbox = Inbox()
    channel = engine.channel("sturdy")
    channel.on_message(inbox)
    frame = peer.call("send_captured", engine.address, "sturdy", "ok", b"payload")
    assert [(m.kind, m.data) for m in inbox.wait(1)] == [("ok", b"payload")]
    garbage = [
        b"", b"x", b"RFCS", frame[:40], b"RFCS\x02" + frame[5:], b"\xff" * 300, b"RFHI\x01\x00\x05\x00abc"
    ]
    for g in garbage:
        assert peer.call("send_raw", engine.address, g) is True
    assert peer.call("send", engine.address, "sturdy", "ok", b"payload") is True
    assert [(m.kind, m.data) for m in inbox.wait(2)] == [("ok", b"payload")] * 2
    wait_until(lambda: engine.frames_dropped["malformed"] == len(garbage), 10, "every garbage frame dropped")
    channel.close()


def test_immediate_ranges_are_disjoint_and_run_out_with_a_clear_error(provider: str) -> None:
    with TransferEngine(provider, 1, **engine_kwargs(provider)) as eng:
        small = eng.channel("small", imms=10)
        assert small.imms == ImmRange(IMM_FIRST, 10)
        with pytest.raises(ChannelError, match="already open"):
            eng.channel("small")
        big = eng.channel("big", imms=2**32 - IMM_FIRST - 10)
        with pytest.raises(ChannelError, match=r"channel 'one': no room for 1 immediates.*exhausted"):
            eng.channel("one", imms=1)
        none = eng.channel("no-imms")  # a channel without immediates needs no room
        with pytest.raises(ValueError, match="outside the range's 0 values"):
            none.imm(0)
        with pytest.raises(ValueError, match="outside the range's 10 values"):
            small.imm(10)
        small.close()
        again = eng.channel("one", imms=4)  # a closed channel's values are free again
        assert again.imms == ImmRange(IMM_FIRST, 4)
        with pytest.raises(ChannelError, match="no room for 7"):
            eng.channel("seven", imms=7)  # 6 left in one block
        assert eng.channel("six", imms=6).imms == ImmRange(IMM_FIRST + 4, 6)
        waiting = big.expect(5)
        big.close()
        with pytest.raises(ChannelError, match="'big' closed"):
            waiting.result(1)
        with pytest.raises(ChannelError, match="closed"):
            big.send(eng.address, "x")
        assert eng.channel("big", imms=2**32 - IMM_FIRST - 10).imms.base == IMM_FIRST + 10


# ----- anything a peer can send: the hub (hypothesis) ----------------------------------------------
class _Loopback:
    """Test double for the fabric between in-process hubs (frames hand-delivered, no engine)."""

    timeout_s = 5.0

    def __init__(self, name: bytes) -> None:
        self.address = EngineAddress("tcp", (name,)).to_bytes()
        self.imm = ImmCounter()
        self.hubs: dict[bytes, ChannelHub] = {}
        self.sent: list[bytes] = []

    def expect(self, imm: int, count: int = 1) -> Future[None]:
        return self.imm.expect(imm, count)

    def send(self, peer_address: bytes, frame: bytes) -> Future[None]:
        self.sent.append(frame)
        hub = self.hubs.get(peer_address)
        if hub is not None:
            hub.deliver(frame)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _hub_pair() -> tuple[ChannelHub, ChannelHub, _Loopback, _Loopback]:
    ta, tb = _Loopback(b"a"), _Loopback(b"b")
    a, b = ChannelHub(ta), ChannelHub(tb)
    ta.hubs[tb.address] = b
    tb.hubs[ta.address] = a
    return a, b, ta, tb


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_arbitrary_bytes_never_raise_and_never_grow_state(data: bytes) -> None:
    hub = ChannelHub(_Loopback(b"me"))
    got: list[Message] = []
    hub.open("known", 0).on_message(got.append)
    for x in (data, b"RFCS" + data, b"RFCS\x01" + data, b"RFHA\x01" + data):
        hub.deliver(x)  # never raises
    assert got == []
    assert hub.early() == 0
    assert hub.sessions.sessions() == 0


@settings(max_examples=60, deadline=None)
@given(
    name=st.text(min_size=1, max_size=40).filter(lambda s: len(s.encode()) < 256),
    kind=st.text(min_size=1, max_size=20).filter(lambda s: len(s.encode()) < 256),
    data=st.binary(max_size=2000),
)
def test_frames_round_trip_and_early_frames_are_bounded(name: str, kind: str, data: bytes) -> None:
    a, b, ta, tb = _hub_pair()
    ch = a.open(name, 0)
    got: list[Message] = []
    for _ in range(EARLY_PER_SENDER + 5):  # a channel b has not opened: kept up to the bound, then counted
        ch.send(tb.address, kind, data).result(1)
    assert b.early() == EARLY_PER_SENDER
    assert b.dropped["overflow"] == 5
    b.open(name, 0).on_message(got.append)
    assert got == [Message(name, kind, ta.address, data)] * EARLY_PER_SENDER
    assert b.early() == 0
    assert EARLY_PER_SENDER < EARLY_LIMIT


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3), max_leaves=6))
def test_immediate_ranges_from_peers_are_checked(doc: object) -> None:
    try:
        r = ImmRange.from_json(doc)
    except ValueError:
        return
    assert 0 <= r.base <= r.base + r.count <= 2**32
    assert r.to_json() == doc

