"""KV liveness: a failed or expired request fails its waiters, tells its sender, and its slot is not
reused while its late immediates can still land (a receiver against a raw peer process that writes
exactly the immediates a test names); a cancelled request stops its sender."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import numpy as np
import pytest

from backends import MemoryRegionDescriptor, TransferEngine, TransferTimeout
from backends.kv import IncomingRequest, KvError, KvPool, KvReceiver, KvSender
from backends.providers.libfabric import refuses_forged_writes
from tests.backends.conftest import Peer, skip_unless_pairs_within_process, start_peer
from tests.backends.kv.raw import welcome
from tests.backends.peer import engine_kwargs, pattern
from tests.waiting import holds_for, wait_until

DONE = -1


def _imms(inc: IncomingRequest, *layers: int) -> list[int]:
    return [inc.done_imm if layer == DONE else inc.layer_imm(layer) for layer in layers]


def _request_once_free(rx: KvReceiver, sender: bytes, rid: str, pages: list[int]) -> IncomingRequest:
    """rx.request, as soon as a slot is out of quarantine (until then it refuses: "busy or resting")."""

    def attempt() -> IncomingRequest | None:
        try:
            return rx.request(sender, rid, pages)
        except KvError as exc:
            if "busy or resting" not in str(exc):
                raise
            return None

    incoming = wait_until(attempt, 10, f"a free slot for request {rid}")
    assert incoming is not None  # wait_until returns the first truthy answer
    return incoming


def _grant_of(raw: Peer, rx_address: bytes, rid: str) -> bytes | None:
    """The descriptor of the first region granted to the raw peer for request rid (from its want)."""
    for kind, data, _ in raw.call("inbox", "kv", 0, 0):
        fields = json.loads(data)
        if kind == "want" and fields["rid"] == rid:
            _, count, regions = fields["grant"][0]
            base, *keys = regions[0]
            return MemoryRegionDescriptor(rx_address, tuple(keys), base, count * 64, "write").to_bytes()
    return None


@pytest.fixture
def engine(provider: str) -> Iterator[TransferEngine]:
    with TransferEngine(provider, 2, timeout_s=5.0, reorder_for_test=True, **engine_kwargs(provider)) as eng:
        yield eng


@pytest.fixture(scope="module")
def raw_sender(provider: str) -> Iterator[Peer]:
    p = start_peer(provider, [("unused", 4096, "rw")])
    yield p
    p.stop()


def _refuse(raw: Peer, rx: KvReceiver, rid: str) -> None:
    """The raw peer refuses request rid, as a sender would."""
    data = json.dumps({"rid": rid, "reason": "test"}).encode()
    assert raw.call("send", rx.engine.address, "kv", "failed", data) is True


@pytest.mark.timeout(120)
def test_a_failed_requests_late_immediates_never_complete_a_later_request(
    engine: TransferEngine, raw_sender: Peer
) -> None:
    """Failed before: the slot went round-robin, so request c reused failed request a's slot and its
    layer 2 and completion counted as landed at once from a's late immediates."""
    rx = KvReceiver(KvPool(engine, layers=3, pages=8, page_bytes=64), timeout_s=20.0, slots=2)
    welcome(rx, raw_sender)
    desc = rx.pool.descriptor.to_bytes()
    a = rx.request(raw_sender.address, "a", [0])
    _refuse(raw_sender, rx, "a")
    with pytest.raises(KvError, match="refused"):
        a.wait(10)
    b = rx.request(raw_sender.address, "b", [1])
    assert raw_sender.call("write_imms", _imms(b, 0, 1, 2, DONE), desc) is True
    b.wait(10)
    late = _imms(a, 2, DONE)  # a's sender had these in flight when a failed
    assert raw_sender.call("write_imms", late, desc) is True
    wait_until(lambda: all(engine.imm.pending(v) == 1 for v in late), 10, "a's late immediates pending")
    c = rx.request(raw_sender.address, "c", [2])
    # a's late immediates sit on the slot c reuses: were they counted, c's layers would complete at once
    holds_for(lambda: not any(f.done() for f in c._layers) and not c._complete.done(), 0.3, "c incomplete")
    _refuse(raw_sender, rx, "c")
    with pytest.raises(KvError, match="refused"):
        c.wait(10)
    # both slots now rest; they come back after quarantine_s, with a's stale counts gone
    with pytest.raises(KvError, match="busy or resting"):
        rx.request(raw_sender.address, "d", [3])
    rx.quarantine_s = 0.0
    rx._resting = type(rx._resting)((0.0, s) for _, s in rx._resting)
    d = rx.request(raw_sender.address, "d", [3])
    assert all(engine.imm.pending(v) == 0 for v in late)
    # nothing was written for d: a stale count would complete it within the window
    holds_for(lambda: not any(f.done() for f in d._layers) and not d._complete.done(), 0.2, "d incomplete")
    # a's and c's senders were told to stop
    got = raw_sender.call("inbox", "kv", 6, 10)  # wants for a, b, c, d; cancels for a and c
    cancels = {json.loads(data)["rid"] for kind, data, _ in got if kind == "cancel"}
    assert cancels >= {"a", "c"}


@pytest.mark.timeout(120)
def test_a_request_past_its_deadline_fails_its_waiters_and_frees_its_slot(
    engine: TransferEngine, raw_sender: Peer
) -> None:
    rx = KvReceiver(
        KvPool(engine, layers=2, pages=8, page_bytes=64), timeout_s=5.0, slots=1,
        request_timeout_s=1.0, quarantine_s=0.5,
    )
    welcome(rx, raw_sender)
    e = rx.request(raw_sender.address, "e", [0])
    t0 = time.monotonic()
    grant = wait_until(lambda: _grant_of(raw_sender, engine.address, "e"), 10, "the sender's grant for e")
    page = rx.pool.buffer[:64]  # layer 0, K, page 0: the grant's first region
    assert raw_sender.call("fill", "unused", 5) is True
    assert raw_sender.call("write", "unused", 0, 64, grant, 0, None) is True  # pending: its page is granted
    # shm 2.5 may land it later
    wait_until(lambda: np.array_equal(page, pattern(5, 64)), 10, "the granted write landed")
    with pytest.raises(TransferTimeout, match="request_timeout_s"):
        e.wait(10)
    assert time.monotonic() - t0 < 3.0
    if refuses_forged_writes(engine.provider):  # shm before libfabric 2.5 checks no key (docs/kv.md)
        assert raw_sender.call("fill", "unused", 6) is True
        raw_sender.call("write", "unused", 0, 64, grant, 0, None)  # revoked: refused (tcp) or dropped (shm)
        # what did not land cannot be waited for: a landed write would show within the window
        holds_for(lambda: np.array_equal(page, pattern(5, 64)), 0.3, "the revoked page unchanged")
    with pytest.raises(TransferTimeout, match="request_timeout_s"):
        e.wait_layer(0, 10)
    assert not engine.imm._waiters  # its expects were withdrawn
    f = _request_once_free(rx, raw_sender.address, "f", [1])  # the one slot comes back after quarantine_s
    desc = rx.pool.descriptor.to_bytes()
    assert raw_sender.call("write_imms", _imms(f, 1, 0, DONE), desc) is True
    f.wait(10)


@pytest.mark.timeout(120)
def test_a_cancelled_request_stops_its_sender(provider: str) -> None:
    skip_unless_pairs_within_process(provider)
    kw = engine_kwargs(provider)
    with (
        TransferEngine(provider, 1, timeout_s=5.0, **kw) as a,
        TransferEngine(provider, 1, timeout_s=5.0, **kw) as b,
    ):
        sender = KvSender(KvPool(a, layers=2, pages=8, page_bytes=64))
        receiver = KvReceiver(KvPool(b, layers=2, pages=8, page_bytes=64), timeout_s=10)
        receiver.join(sender.address)
        out = sender.start("x", [1, 2])
        inc = receiver.request(sender.address, "x", [3, 4])
        wait_until(lambda: out._want is not None, 10, "the want reached the sender")
        inc.cancel("decode went away")
        with pytest.raises(KvError, match="cancelled"):
            out.wait(10)
        with pytest.raises(KvError, match="decode went away"):
            inc.wait(1)


@pytest.mark.timeout(60)
def test_immediates_written_ahead_into_a_free_slot_do_not_count(
    engine: TransferEngine, raw_sender: Peer
) -> None:
    """A peer that sprays a slot's immediates before any request uses it completes nothing."""
    rx = KvReceiver(KvPool(engine, layers=2, pages=8, page_bytes=64), timeout_s=5.0, slots=1)
    welcome(rx, raw_sender)
    ahead = [rx.channel.imm(i) for i in range(3)]  # slot 0: layers 0, 1 and the completion
    assert raw_sender.call("write_imms", ahead, rx.pool.descriptor.to_bytes()) is True
    wait_until(lambda: all(engine.imm.pending(v) == 1 for v in ahead), 10, "the sprayed immediates pending")
    g = rx.request(raw_sender.address, "g", [0])
    holds_for(lambda: not g.done.done(), 0.2, "g incomplete")  # counted sprays would complete g at once
    assert all(engine.imm.pending(v) == 0 for v in ahead)
    g.cancel()
