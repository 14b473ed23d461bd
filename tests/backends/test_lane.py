"""FastLane (caller-driven batches) against a real peer process, on every provider, reordering on."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from backends import MemoryRegionDescriptor, PeerUnreachable, RemoteAccessError, TransferEngine, TransferError
from backends.lane import FastLane
from backends.providers.libfabric import libfabric_version
from tests.backends.conftest import Peer, start_peer
from tests.backends.peer import digest, engine_kwargs, pattern

MiB = 1 << 20


@pytest.fixture(scope="module")
def peer(provider: str) -> Iterator[Peer]:
    """A lighter peer than the conformance suite's (no 1 GiB regions to fill)."""
    p = start_peer(provider, [("src", 16 * MiB, "read"), ("small", 16 * MiB, "rw"), ("ro", 1 * MiB, "read")])
    yield p
    p.stop()


@pytest.fixture
def engine(provider: str) -> Iterator[TransferEngine]:
    with TransferEngine(provider, 2, timeout_s=8.0, reorder_for_test=True, **engine_kwargs(provider)) as eng:
        yield eng


@pytest.fixture
def lane(engine: TransferEngine) -> Iterator[FastLane]:
    with FastLane(engine) as ln:
        yield ln


@pytest.mark.timeout(90)
def test_small_reads_and_writes_byte_for_byte(engine: TransferEngine, lane: FastLane, peer: Peer) -> None:
    src = MemoryRegionDescriptor.from_bytes(peer.descs["src"])
    small = MemoryRegionDescriptor.from_bytes(peer.descs["small"])
    buf = np.zeros(1 * MiB, dtype=np.uint8)
    region = engine.register(buf, "rw")
    expected = pattern(1, 1 * MiB)
    for i in range(500):  # one op at a time, spun to completion on this thread
        lane.read(region, i * 64, 64, src, i * 64).wait(10)
    assert np.array_equal(buf[: 500 * 64], expected[: 500 * 64])
    data = np.random.default_rng(9).integers(0, 256, 1 * MiB, dtype=np.uint8)
    region2 = engine.register(data, "read")
    batch = lane.batch("many writes")
    order = np.random.default_rng(10).permutation(4096)
    for j in order:  # 4096 x 256 B in one batch, one handle
        batch.write(region2, int(j) * 256, 256, small, int(j) * 256)
    lane.submit(batch).wait(30)
    assert batch.done
    assert peer.call("digest", "small", 0, 1 * MiB) == digest(data)


@pytest.mark.timeout(90)
def test_batch_immediate_arrives_after_all_its_data(
    engine: TransferEngine, lane: FastLane, peer: Peer
) -> None:
    small = peer.descs["small"]
    for page in (512, 16 << 10):  # below and above shm's inject size
        data = np.random.default_rng(page).integers(0, 256, 64 * page, dtype=np.uint8)
        region = engine.register(data, "read")
        imm = 7000 + page
        assert peer.call("expect", f"b{page}", imm, 1) is True
        spans = [(p * page, ((p * 37) % 64) * page, page) for p in range(64)]
        lane.submit(lane.batch("paged").write_spans(region, spans, small).write_imm(imm, small)).wait(30)
        assert peer.call("wait_expect", f"b{page}", 10) is True
        want = np.zeros(64 * page, dtype=np.uint8)
        for lo, ro, n in spans:
            want[ro : ro + n] = data[lo : lo + n]
        assert peer.call("digest", "small", 0, 64 * page) == digest(want)
        region.close()


@pytest.mark.timeout(60)
def test_bad_input_is_refused_before_posting(engine: TransferEngine, lane: FastLane, peer: Peer) -> None:
    buf = np.zeros(4096, dtype=np.uint8)
    region = engine.register(buf, "rw")
    with pytest.raises(RemoteAccessError, match="outside"):
        lane.batch().read(region, 0, 8192, peer.descs["src"], 0)
    with pytest.raises(RemoteAccessError, match="not write"):
        lane.batch().write(region, 0, 64, peer.descs["ro"], 0)
    with pytest.raises(ValueError, match="32-bit"):
        lane.batch().write_imm(2**32, peer.descs["small"])
    submitted = lane.submit(lane.batch().read(region, 0, 64, peer.descs["src"], 0))
    with pytest.raises(TransferError, match="already submitted"):
        lane.submit(submitted)
    submitted.wait(10)
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            lane.batch()
        except TransferError as exc:
            errors.append(exc)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert errors
    assert "thread" in str(errors[0])


@pytest.mark.timeout(90)
def test_dead_peer_fails_the_batch_within_the_timeout(provider: str, peer: Peer) -> None:
    if provider == "shm" and libfabric_version() < (2, 5):
        pytest.skip("shm 1.17: after a peer dies the provider can stall its endpoint (docs/transport.md)")
    with (
        TransferEngine(provider, 1, timeout_s=3.0, **engine_kwargs(provider)) as eng,
        FastLane(eng) as lane,
    ):
        victim = start_peer(provider, [("src", 64 * MiB, "read")], domains=1, reorder=False)
        buf = np.zeros(64 * MiB, dtype=np.uint8)
        region = eng.register(buf, "write")
        try:
            lane.read(region, 0, 4096, victim.descs["src"], 0).wait(10)  # connected
            os.kill(victim.proc.pid or 0, signal.SIGKILL)
            victim.proc.join(5)
            start = time.monotonic()
            batch = lane.submit(lane.batch("after death").read(region, 0, 64 * MiB, victim.descs["src"], 0))
            with pytest.raises(PeerUnreachable) as err:
                batch.wait()
            assert time.monotonic() - start < 3.0 + 5
            assert "after death" in str(err.value)
            # The lane still works with a live peer.
            lane.read(region, 0, 1 * MiB, peer.descs["src"], 0).wait(10)
            assert np.array_equal(buf[: 1 * MiB], pattern(1, 1 * MiB))
        finally:
            victim.conn.close()
