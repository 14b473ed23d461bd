"""A live RL session fed malformed and hostile control messages (hypothesis): from a roster trainer's
channel to the receiver, from the receiver's channel to the trainer, and from an engine outside the
roster. No callback or control thread dies, queues and versions stay bounded, registered slots are
the only memory written, and an honest update applies afterwards."""

from __future__ import annotations

import itertools
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends import TransferEngine
from backends.channel import Channel
from backends.rl import RLReceiver, RLTrainer, TrainerRank
from backends.rl import messages as protocol
from tests.backends.rl.test_session import SPECS, fill, make_trainer
from tests.waiting import wait_until


class Live:
    def __init__(self) -> None:
        self.engines = [TransferEngine("tcp", 1, timeout_s=2.0, host="127.0.0.1") for _ in range(3)]
        teng, reng, other = self.engines
        self.trainer: RLTrainer = make_trainer(teng)
        roster = [TrainerRank(teng.address, 1, 0)]
        self.receiver = RLReceiver(  # with a delta staging area: BEGIN's delta and HELLO's are fed too
            reng, session="s", specs=SPECS, trainers=roster, index=0, update_timeout_s=0.5, delta_fraction=0.5
        )
        self.trainer.wait_receivers(1, 10)
        self.outsider = other.channel(protocol.channel_name("s"))
        self.outsider.on_message(lambda _m: None)

    def close(self) -> None:
        self.receiver.close()
        self.trainer.close()
        for e in self.engines:
            e.close()


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    lv = Live()
    yield lv
    lv.close()


_ints = st.one_of(st.integers(-3, 40), st.integers(-(2**70), 2**70), st.just(2**60))
_json = st.recursive(
    st.none() | st.booleans() | _ints | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=10,
)
_ends = itertools.count()
_kinds = st.sampled_from(
    [protocol.HELLO, protocol.READY, protocol.BEGIN, protocol.REJECT, protocol.DROPPED, "x"]
)


@st.composite
def hostile(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """(who sends: trainer/receiver/outsider, kind, body)."""
    who = draw(st.sampled_from(["trainer", "receiver", "outsider"]))
    kind = draw(_kinds)
    if draw(st.integers(0, 4)) == 0:
        return who, kind, draw(st.binary(max_size=48))
    fields: dict[str, Any] = {
        "version": draw(_ints), "slot": draw(st.one_of(_ints, st.none())), "receiver": draw(_ints),
        "reason": draw(st.text(max_size=20)),
    }
    if draw(st.booleans()):
        names = ["descs", "slots", "tp", "digest", "imms", "contributors", "holds", "delta"]
        name = draw(st.sampled_from(names))
        fields[name] = draw(_json)
    if draw(st.booleans()):  # a delta of the right shape, with any values
        fields["delta"] = {"base": draw(_ints), "bytes": draw(_ints), "digest": draw(st.text(max_size=8))}
    return who, kind, json.dumps(fields).encode()


@pytest.mark.timeout(300)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(hostile(), min_size=1, max_size=6))
def test_hostile_rl_messages_never_kill_grow_or_stop_an_honest_update(
    live: Live, messages: list[tuple[str, str, bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)  # the end markers below are logged as warnings
    t, r = live.trainer, live.receiver
    before = r.version
    foreign = r.foreign + sum(who == "outsider" for who, _, _ in messages)  # the outsider's, to the receiver
    for who, kind, body in messages:
        if who == "trainer":
            t.channel.send(r.engine.address, kind, body).result(5)
        elif who == "receiver":
            r.channel.send(t.engine.address, kind, body).result(5)
        else:
            live.outsider.send(r.engine.address, kind, body).result(5)
            live.outsider.send(t.engine.address, kind, body).result(5)
    # Each channel delivers in order, and a control thread handles its inbox in order: a message of an
    # unknown kind sent last on each route, logged when handled, marks the hostile ones before it handled.
    n = next(_ends)
    # (A dead control thread never logs it: the wait ends then too, and the assertions below say so.)
    routes: list[tuple[Channel, bytes, threading.Thread, str]] = [
        (t.channel, r.engine.address, r._thread, f"end-t{n}"),
        (r.channel, t.engine.address, t._thread, f"end-r{n}"),
        (live.outsider, t.engine.address, t._thread, f"end-o{n}"),
    ]
    for channel, to, _, marker in routes:
        channel.send(to, marker).result(5)
    for _, _, thread, marker in routes:

        def handled(m: str = marker, th: threading.Thread = thread) -> bool:
            return any(m in rec.getMessage() for rec in list(caplog.records)) or not th.is_alive()

        wait_until(handled, 10, f"the session handles the end marker {marker!r} after the hostile messages")
    wait_until(lambda: r.foreign >= foreign, 10, "the receiver drops the outsider's messages as foreign")
    assert r._thread.is_alive()
    assert t._thread.is_alive()
    assert len(r._inbox) <= protocol.MAX_INBOX
    assert len(t._inbox) <= protocol.MAX_INBOX
    with r._cond:
        top = max(r._version, r._abandoned_up_to, r._pending.version if r._pending else 0)
    assert top - before <= len(messages) * protocol.MAX_VERSION_JUMP
    assert [rec.address for rec in t._receivers.values()] == [r.engine.address]
    assert [m.getMessage() for m in caplog.records if "raised" in m.getMessage()] == []
    # a roster trainer could have begun a version: the honest trainer updates past whatever it left
    # (test-only: set its last version there)
    r.rejected = None
    with t._cond:
        t._version = top
    fill(t, float(top % 1000))
    res = t.update(top + 1, timeout_s=10)
    if res.applied != (0,):  # the receiver's own channel sent a READY for a slot it does not offer
        r._hello()
        t.wait_receivers(1, 5)
        res = t.update(top + 2, timeout_s=10)
    assert res.applied == (0,), res
