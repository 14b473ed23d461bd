"""backends.DigestJob: digests the job's native thread computes as reads land equal xxh3-128 over each span
(what the loader's host digest computes), whatever the layout and the landing order;
and through a real engine reading from a peer process, chunks split over two domains and completing
out of order."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends import DigestJob, TransferEngine, TransferError, native_digests_available
from backends.providers._native import lib
from tests.backends.conftest import Peer, start_peer
from tests.backends.peer import digest, engine_kwargs, host_buffer, pattern

pytestmark = pytest.mark.skipif(not native_digests_available(), reason="binding built without xxHash")

Layout = tuple[list[int], list[list[tuple[int, int]]], list[list[tuple[int, int]]]]


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    """Regions, per region sorted disjoint reads (gaps between them: padding) and spans inside the
    read bytes (overlapping, repeated, nested: tied and aliased tensors)."""
    sizes, reads, spans = [], [], []
    for _ in range(draw(st.integers(1, 3))):
        cuts = sorted(draw(st.lists(st.integers(0, 600), min_size=0, max_size=12, unique=True)))
        rds = [(a, b - a) for a, b in zip(cuts[::2], cuts[1::2], strict=False) if b > a]
        size = max([o + n for o, n in rds], default=0) + draw(st.integers(0, 40))
        sps: list[tuple[int, int]] = []
        for off, n in rds:  # spans lie within runs of reads (what plan_reads produces)
            for _ in range(draw(st.integers(0, 3))):
                a = draw(st.integers(off, off + n))
                sps.append((a, draw(st.integers(a, off + n))))
        if len(rds) >= 2 and draw(st.booleans()):  # a span across two adjacent reads
            (o1, n1), (o2, n2) = rds[0], rds[1]
            if o1 + n1 == o2:
                sps.append((o1, o2 + n2))
        sizes.append(size)
        reads.append(rds)
        spans.append(sorted(sps, key=lambda s: s[0]))
    return sizes, reads, spans


def _streaming(buf: np.ndarray, lo: int, hi: int) -> str:
    return digest(buf[lo:hi])


@given(layouts(), st.randoms(use_true_random=False), st.integers(1, 64))
@settings(max_examples=300, deadline=None)
def test_digests_equal_streaming_xxh3_for_any_layout_and_landing_order(
    layout: Layout, rnd: random.Random, piece: int
) -> None:
    sizes, reads, spans = layout
    bufs = [pattern(7 + q, max(n, 1)).copy() for q, n in enumerate(sizes)]
    job = DigestJob([(b.ctypes.data, n) for b, n in zip(bufs, sizes, strict=True)], reads, spans)
    try:
        # every read lands in pieces of at most `piece` bytes (the engine's chunks), in random order
        landings = [
            (bufs[q].ctypes.data + k, min(piece, off + n - k))
            for q, rds in enumerate(reads)
            for off, n in rds
            for k in range(off, off + n, piece)
        ]
        rnd.shuffle(landings)
        for addr, n in landings:
            lib.rf_hjob_landed(job._require(), addr, n)
        job.wait(5.0)
        want = [_streaming(bufs[q], a, b) for q, sps in enumerate(spans) for a, b in sps]
        assert job.hexdigests() == want
    finally:
        job.release()


def test_unfinished_job_times_out_and_a_landing_outside_its_reads_fails_it() -> None:
    buf = np.zeros(64, dtype=np.uint8)
    with DigestJob([(buf.ctypes.data, 64)], [[(0, 32), (32, 32)]], [[(0, 64)]]) as job:
        lib.rf_hjob_landed(job._require(), buf.ctypes.data, 32)
        with pytest.raises(TimeoutError):
            job.wait(0.05)
        with pytest.raises(TransferError, match="not finished"):
            job.hexdigests()
        lib.rf_hjob_landed(job._require(), buf.ctypes.data + 48, 32)  # runs past its read
        with pytest.raises(TransferError, match="outside its plan"):
            job.wait(1.0)


def test_the_landing_thread_only_records_and_the_job_thread_hashes() -> None:
    """A core that reaps a read must not stall on hashing it: rf_hjob_landed returns at once and the
    job's own thread hashes (256 MiB takes tens of ms; the landing call itself microseconds)."""
    n = 256 << 20
    buf = np.ones(n, dtype=np.uint8)
    with DigestJob([(buf.ctypes.data, n)], [[(0, n)]], [[(0, n)]]) as job:
        t0 = time.perf_counter()
        lib.rf_hjob_landed(job._require(), buf.ctypes.data, n)
        landing_s = time.perf_counter() - t0
        job.wait(10.0)
        assert landing_s < job.hash_seconds / 4, f"the landing call took {landing_s:.4f} s: it hashed"
        assert job.hexdigests() == [_streaming(buf, 0, n)]


def test_the_plan_is_checked_before_anything_native_exists() -> None:
    with pytest.raises(ValueError, match="unsorted"):
        DigestJob([(4096, 100)], [[(50, 10), (0, 10)]], [[]])
    with pytest.raises(ValueError, match="sorted and inside"):
        DigestJob([(4096, 100)], [[(0, 100)]], [[(0, 101)]])


def test_a_released_job_hashes_nothing_more_and_can_be_released_twice() -> None:
    buf = np.zeros(64, dtype=np.uint8)
    job = DigestJob([(buf.ctypes.data, 64)], [[(0, 64)]], [[(0, 64)]])
    job.release()
    job.release()
    with pytest.raises(TransferError, match="released"):
        job.wait(1.0)


@pytest.fixture(scope="module")
def peer(provider: str) -> Iterator[Peer]:
    """A peer whose source holds the largest read here (64 MiB), not the conformance suite's GiBs: a
    1 GiB pattern costs seconds to draw."""
    p = start_peer(provider, [("src", 64 << 20, "read")])
    yield p
    p.stop()


@pytest.fixture(scope="module")
def engine(provider: str, peer: Peer) -> Iterator[TransferEngine]:
    with TransferEngine(
        provider, 2, timeout_s=8.0, chunk_bytes=64 << 10, reorder_for_test=True, **engine_kwargs(provider)
    ) as eng:
        yield eng


@given(layouts(), st.integers(0, 1 << 20))
@settings(max_examples=25, deadline=None)
def test_reads_from_a_peer_process_digest_as_they_land(
    engine: TransferEngine, peer: Peer, layout: Layout, src_off: int
) -> None:
    """Reads scaled up to ~0.5 MiB, split into 64 KiB chunks over two domains, posted shuffled."""
    sizes, reads, spans = layout
    scale = 1024
    sizes = [n * scale for n in sizes]
    reads = [[(o * scale, n * scale) for o, n in rds] for rds in reads]
    spans = [[(a * scale, b * scale) for a, b in sps] for sps in spans]
    bufs = [host_buffer(max(n, 1)) for n in sizes]
    regions = [engine.register(b, "rw") for b in bufs]
    src = pattern(1, src_off + max(sizes) + 1)
    job = DigestJob([(b.ctypes.data, n) for b, n in zip(bufs, sizes, strict=True)], reads, spans)
    try:
        futs = [
            engine.read(regions[q], off, n, peer.descs["src"], src_off + off, digest=job)
            for q, rds in enumerate(reads)
            for off, n in rds
        ]
        for f in futs:
            f.result(timeout=30)
        job.wait(10.0)
        for q, rds in enumerate(reads):  # the bytes themselves landed
            for off, n in rds:
                assert digest(bufs[q][off : off + n]) == digest(src[src_off + off : src_off + off + n])
        want = [_streaming(bufs[q], a, b) for q, sps in enumerate(spans) for a, b in sps]
        assert job.hexdigests() == want
        assert job.hash_seconds >= 0.0
    finally:
        job.release()
        for r in regions:
            engine.deregister(r)


def test_release_while_the_job_hashes_waits_for_it(engine: TransferEngine, peer: Peer) -> None:
    """Releasing from another thread in the middle of a pull of 64 MiB neither crashes nor hangs, and
    the reads still complete (their records reach Python)."""
    n = 64 << 20
    buf = host_buffer(n)
    region = engine.register(buf, "rw")
    job = DigestJob([(buf.ctypes.data, n)], [[(k, 1 << 20) for k in range(0, n, 1 << 20)]], [[(0, n)]])
    try:
        futs = [
            engine.read(region, k, 1 << 20, peer.descs["src"], k, digest=job) for k in range(0, n, 1 << 20)
        ]
        releaser = threading.Thread(target=job.release)
        releaser.start()
        for f in futs:
            f.result(timeout=30)
        releaser.join(10)
        assert not releaser.is_alive()
    finally:
        job.release()
        engine.deregister(region)
