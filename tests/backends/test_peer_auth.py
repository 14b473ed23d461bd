"""Sealed channel frames: a forging peer process cannot speak for another engine, replayed frames are
dropped, and nothing it sends changes a receiver's state (real engines in separate processes); the
replay window and the seal itself, in process."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends import Message, TransferEngine
from backends.peer_auth import REPLAY_WINDOW, check_window
from tests.backends.conftest import Peer, start_peer
from tests.backends.peer import engine_kwargs
from tests.backends.test_channel import Inbox, _hub_pair
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def honest(provider: str) -> Iterator[Peer]:
    p = start_peer(provider, [("small", 4096, "rw")], domains=1)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def forger(provider: str) -> Iterator[Peer]:
    p = start_peer(provider, [("small", 4096, "rw")], domains=1)
    yield p
    p.stop()


@pytest.fixture
def engine(provider: str) -> Iterator[TransferEngine]:
    with TransferEngine(provider, 1, timeout_s=8.0, reorder_for_test=True, **engine_kwargs(provider)) as eng:
        yield eng


def legacy_frame(channel: str, kind: str, sender: bytes, data: bytes) -> bytes:
    """The unsealed frame main accepted: the sender is whatever the body says."""
    n, k = channel.encode(), kind.encode()
    return struct.pack("<4sBBBxH", b"RFCH", 1, len(n), len(k), len(sender)) + n + k + sender + data


def sealed_guess(channel: str, kind: str, sender: bytes, data: bytes, seq: int = 1) -> bytes:
    """A sealed frame claiming `sender` as a session initiator, with a made-up nonce and tag."""
    n, k = channel.encode(), kind.encode()
    head = struct.pack("<4sBBHBBxx16sQ", b"RFCS", 1, 1, len(sender), len(n), len(k), os.urandom(16), seq)
    return head + sender + n + k + data + os.urandom(16)


@pytest.mark.timeout(90)
def test_a_forging_peer_cannot_speak_for_another_engine_or_replay_its_frames(
    engine: TransferEngine, honest: Peer, forger: Peer
) -> None:
    inbox = Inbox()
    channel = engine.channel("guarded")
    channel.on_message(inbox)
    # the honest peer's frame arrives with its proven address
    frame = honest.call("send_captured", engine.address, "guarded", "hi", b"honest")
    assert [(m.kind, m.data, m.sender) for m in inbox.wait(1)] == [("hi", b"honest", honest.address)]
    # the forger claims the honest peer's address: in the old format, sealed with a guessed tag,
    # and by starting a handshake in its name (the answer goes to the honest peer, which drops it)
    hello = struct.pack("<4sBxH", b"RFHI", 1, len(honest.address)) + honest.address + os.urandom(16)
    for forged in (
        legacy_frame("guarded", "hi", honest.address, b"forged"),
        sealed_guess("guarded", "hi", honest.address, b"forged"),
        hello,
        sealed_guess("guarded", "hi", honest.address, b"forged", seq=2),
    ):
        assert forger.call("send_raw", engine.address, forged) is True
    # and replays the honest peer's own frame, byte for byte
    assert forger.call("send_raw", engine.address, frame) is True
    wait_until(lambda: engine.frames_dropped["replayed"] == 1, 10, "the replayed frame dropped")
    assert engine.frames_dropped["forged"] == 2
    assert engine.frames_dropped["malformed"] == 1  # the old format
    # the honest peer still gets through, and nothing forged was delivered
    assert honest.call("send", engine.address, "guarded", "hi", b"again") is True
    got = inbox.wait(2)
    assert [(m.data, m.sender) for m in got] == [(b"honest", honest.address), (b"again", honest.address)]
    # the forger speaking for itself works, under its own address
    assert forger.call("send", engine.address, "guarded", "hi", b"mine") is True
    assert inbox.wait(3)[2] == Message("guarded", "hi", forger.address, b"mine")
    # answers go back over the session the peer opened
    channel.send(honest.address, "reply", b"r").result(10)
    assert honest.call("inbox", "guarded", 1, 10)[0] == ("reply", b"r", engine.address)


def test_a_frame_opens_only_intact_and_only_once() -> None:
    a, b, ta, tb = _hub_pair()
    got: list[Message] = []
    b.open("c", 0).on_message(got.append)
    ch = a.open("c", 0)
    ch.send(tb.address, "k", b"data").result(1)
    frame = ta.sent[-1]
    assert got == [Message("c", "k", ta.address, b"data")]
    for i in range(len(frame)):  # every byte is covered: flip any one and the frame is dropped
        b.deliver(frame[:i] + bytes([frame[i] ^ 0x40]) + frame[i + 1 :])
    b.deliver(frame)
    assert len(got) == 1
    assert b.dropped["replayed"] == 1
    assert sum(b.dropped.values()) == len(frame) + 1


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 3 * REPLAY_WINDOW), max_size=300))
def test_the_replay_window_accepts_each_number_once(seqs: list[int]) -> None:
    top, seen, accepted = 0, 0, set()
    for seq in seqs:
        nxt = check_window(top, seen, seq)
        if nxt is None:
            assert seq in accepted or seq <= top - REPLAY_WINDOW
        else:
            assert seq not in accepted
            accepted.add(seq)
            top, seen = nxt
        assert seen < 1 << REPLAY_WINDOW


def test_a_keyed_channel_hears_only_holders_of_its_key() -> None:
    key = b"k" * 32
    a, b, ta, tb = _hub_pair()
    got: list[Message] = []
    b.open("keyed", 0, key=key).on_message(got.append)
    a.open("keyed", 0, key=key).send(tb.address, "k", b"ok").result(1)
    assert [m.data for m in got] == [b"ok"]
    a.open("plain", 0)
    for wrong in (b"w" * 32, None):  # another key, or none: a session member without the secret
        a2, b2, ta2, tb2 = _hub_pair()
        b2.open("keyed", 0, key=key).on_message(got.append)
        a2.open("keyed", 0, key=wrong).send(tb2.address, "k", b"no").result(1)
        assert b2.dropped["forged"] == 1
    # early frames are checked when the callback attaches
    a3, b3, ta3, tb3 = _hub_pair()
    a3.open("later", 0, key=b"x" * 32).send(tb3.address, "k", b"early").result(1)
    b3.open("later", 0, key=key).on_message(got.append)
    assert b3.dropped["forged"] == 1
    assert [m.data for m in got] == [b"ok"]
    with pytest.raises(ValueError, match="at least 16 bytes"):
        a.open("short", 0, key=b"short")
