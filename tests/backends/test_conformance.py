"""Conformance suite: every provider must pass it (tcp and shm here; RFORK_TEST_PROVIDERS selects others).

Real processes (spawn), random data checked byte for byte against what the other side holds.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import wait
from typing import Any

import numpy as np
import pytest

from backends import (
    BackendUnavailable,
    MemoryRegionDescriptor,
    Message,
    PeerUnreachable,
    RemoteAccessError,
    TransferEngine,
    TransferError,
)
from backends.providers.libfabric import (
    ALLOW_UNENFORCED_ENV,
    libfabric_version,
    refuses_forged_reads,
    refuses_forged_writes,
)
from backends.spans import page_spans
from tests.backends.conftest import SRC_BYTES, Peer, start_peer
from tests.backends.peer import digest, engine_kwargs, group_pieces, host_buffer, pattern
from tests.waiting import holds_for, wait_until

MiB = 1 << 20


@pytest.fixture
def engine(provider: str) -> Iterator[TransferEngine]:
    # 8 s: a dead-peer bound that a loaded 2-core CI box (spawned peers, 1 GiB moves) never trips by accident
    with TransferEngine(provider, 2, timeout_s=8.0, reorder_for_test=True, **engine_kwargs(provider)) as eng:
        yield eng


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_read_and_write_1gib(engine: TransferEngine, peer: Peer) -> None:
    # Every byte is checked through digests of whole GiBs: a second random GiB to compare with (or a
    # copy to hash) would cost seconds of first-touch page faults on this VM and prove nothing more.
    buf = host_buffer(SRC_BYTES)
    region = engine.register(buf, "rw")
    src = MemoryRegionDescriptor.from_bytes(peer.descs["src"])
    engine.read(region, 0, SRC_BYTES, src, 0).result(60)
    assert digest(buf) == peer.call("digest", "src", 0, SRC_BYTES)
    assert digest(buf[:MiB]) == digest(pattern(1, MiB))  # and it is the random pattern, not zeros
    buf ^= 0x5A  # new contents for the write, still random and unlike anything the peer holds
    engine.write(region, 0, SRC_BYTES, peer.descs["dst"], 0).result(60)
    assert peer.call("digest", "dst", 0, SRC_BYTES) == digest(buf)
    engine.deregister(region)


@pytest.mark.timeout(90)
def test_ten_thousand_small_ops(engine: TransferEngine, peer: Peer) -> None:
    n_ops, size = 10_000, 64
    data = np.random.default_rng(3).integers(0, 256, n_ops * size, dtype=np.uint8)
    back = np.zeros_like(data)
    r_data = engine.register(data, "read")
    r_back = engine.register(back, "write")
    order = list(range(n_ops))
    random.Random(4).shuffle(order)
    futs = [engine.write(r_data, i * size, size, peer.descs["small"], i * size) for i in order[: n_ops // 2]]
    futs += [engine.write(r_data, i * size, size, peer.descs["small"], i * size) for i in order[n_ops // 2 :]]
    done, not_done = wait(futs, 60)
    assert not not_done
    for f in done:
        f.result()
    reads = [engine.read(r_back, i * size, size, peer.descs["small"], i * size) for i in order]
    for f in reads:
        f.result(60)
    assert np.array_equal(back, data)


@pytest.mark.timeout(90)
def test_paged_writes_random_pages_and_strides(engine: TransferEngine, peer: Peer) -> None:
    rng = random.Random(5)
    remote = np.zeros(16 * MiB, dtype=np.uint8)  # model of the peer's "small" region
    peer.call("fill", "small", 0)
    remote[:] = pattern(0, 16 * MiB)
    local = pattern(6, 16 * MiB).copy()
    region = engine.register(local, "read")
    for page_len, src_stride, dst_stride in [
        (4096, 4096, 8192),
        (65536, 65536, 65536),
        (1000, 3000, 1024),
        (MiB, MiB + 4096, MiB),
        (12345, 20000, 12345),
    ]:
        n_src, n_dst = (16 * MiB - 4096) // src_stride, (16 * MiB - 4096) // dst_stride
        count = min(n_src, n_dst, 48)
        src_pages = rng.sample(range(n_src), count)
        dst_pages = rng.sample(range(n_dst), count)
        if page_len == 65536:  # long adjacent runs exercise merging
            src_pages, dst_pages = sorted(src_pages), sorted(dst_pages)
        src_off, dst_off = rng.randrange(0, 4096), rng.randrange(0, 4096)
        engine.write_paged(
            region,
            src_pages,
            src_stride,
            peer.descs["small"],
            dst_pages,
            dst_stride,
            page_len,
            src_offset=src_off,
            dst_offset=dst_off,
        ).result(60)
        for s, d in zip(src_pages, dst_pages, strict=True):
            so, do = src_off + s * src_stride, dst_off + d * dst_stride
            remote[do : do + page_len] = local[so : so + page_len]
        assert peer.call("digest", "small", 0, 16 * MiB) == digest(remote), (page_len, src_stride, dst_stride)


@pytest.mark.timeout(90)
def test_scattered_pages_go_out_as_gathered_writes(engine: TransferEngine, peer: Peer, provider: str) -> None:
    """64 pages of 16 KiB, apart on both sides, then apart only locally: the provider gets one write
    per 4 pages where it scatters (tcp) and, where it does not (shm), per page, or per 4 pages when the
    remote ends follow each other; each domain's writes are one batch (one chunk, one completion);
    every byte lands where it belongs and the immediate comes last."""
    page, count = 16 << 10, 64
    posted: list[tuple[int, int]] = []  # (kind, gathered spans) of every write the providers get
    chunks: list[int] = []  # what Python handed the domains: a batch of writes is one
    for dom in engine._domains:
        submit = dom.submit

        def counting(ops: Any, submit: Any = submit, dom: Any = dom) -> None:
            for op in ops:
                if op.length:
                    chunks.append(1)
                    if op.batch is None:
                        posted.append((op.kind, 1))
                        continue
                    flat = list(op.batch.pieces)
                    pieces = [tuple(flat[i : i + 3]) for i in range(0, len(flat), 3)]
                    groups = group_pieces(pieces, op.batch.max_bytes, dom.max_segs, scatters=dom.scatters)
                    posted.extend((op.kind, len(g)) for g in groups)
            submit(ops)

        dom.submit = counting  # type: ignore[method-assign]
    rng = random.Random(8)
    peer.call("fill", "small", 0)
    remote = pattern(0, 16 * MiB).copy()
    local = pattern(9, 4 * MiB).copy()
    region = engine.register(local, "read")
    scattered = rng.sample(range(256), count), rng.sample(range(256), count)
    local_only = rng.sample(range(256), count), [100 + i for i in range(count)]
    for imm, (src_pages, dst_pages) in enumerate((scattered, local_only), 40):
        assert peer.call("expect", f"g{imm}", imm, 1) is True
        posted.clear()
        chunks.clear()
        dst = peer.descs["small"]
        engine.write_paged(region, src_pages, page, dst, dst_pages, page, page, imm=imm).result(30)
        assert peer.call("wait_expect", f"g{imm}", 10) is True
        for sp, dp in zip(src_pages, dst_pages, strict=True):
            remote[dp * page : (dp + 1) * page] = local[sp * page : (sp + 1) * page]
        assert peer.call("digest", "small", 0, 16 * MiB) == digest(remote)
        gathers = provider != "shm" or dst_pages == local_only[1]
        # pages adjacent on both sides were merged first
        spans = len(page_spans(src_pages, 0, page, dst_pages, 0, page, page))
        assert sum(n for _, n in posted) == spans
        assert len(posted) == (-(-spans // 4) if gathers else spans), posted
        assert len(chunks) == engine.domains  # each domain's writes of the op went as one batch


@pytest.mark.timeout(90)
def test_imm_counter_reordered_before_and_after_arrival(provider: str, peer: Peer) -> None:
    with TransferEngine(provider, 2, timeout_s=3.0, chunk_bytes=256 * 1024, **engine_kwargs(provider)) as eng:
        buf = np.zeros(8 * MiB, dtype=np.uint8)
        region = eng.register(buf, "rw")
        desc = region.descriptor.to_bytes()
        # expect before arrival: a multi-chunk write with imm resolves only once all its data landed
        before = eng.expect(77, 1)
        assert not before.done()
        peer.call("fill", "small", 9)
        assert peer.call("write", "small", 0, 8 * MiB, desc, 0, 77) is True
        before.result(10)
        assert np.array_equal(buf, pattern(9, 16 * MiB)[: 8 * MiB])
        # many values, several arrivals each, expect after arrival
        imms = [v for v in range(1000, 1064) for _ in range(3)]
        random.Random(7).shuffle(imms)
        half = eng.expect(1003, 6)  # waits for more than will come
        assert peer.call("write_imms", imms, desc) is True
        for v in range(1000, 1064):
            if v != 1003:
                eng.expect(v, 3).result(10)
        holds_for(lambda: not half.done(), 0.2, "3 of 6 arrived")  # a miscount would resolve it meanwhile
        assert peer.call("write_imms", [1003] * 3, desc) is True
        half.result(10)
        extra = eng.expect(1000, 1)  # all consumed: nothing left to satisfy this
        holds_for(lambda: not extra.done(), 0.2, "nothing left for 1000")  # a leftover would satisfy it
        assert eng.imm.pending(1000) == 0


@pytest.mark.timeout(90)
def test_imm_from_this_side_with_reordering(engine: TransferEngine, peer: Peer) -> None:
    data = pattern(11, 4 * MiB).copy()
    region = engine.register(data, "read")
    assert peer.call("expect", "k", 5, 41) is True
    futs = [engine.write(region, 0, 4 * MiB, peer.descs["small"], 0, imm=5)]
    futs += [engine.write_imm(5, peer.descs["small"]) for _ in range(20)]
    futs += [
        engine.write_paged(region, [3, 1, 2], 65536, peer.descs["small"], [9, 8, 7], 65536, 65536, imm=5)
        for _ in range(20)
    ]
    for f in futs:
        f.result(30)
    assert peer.call("wait_expect", "k", 10) is True
    assert peer.call("digest", "small", 0, 4096) == digest(data[:4096])


@pytest.mark.timeout(90)
def test_submission_from_16_threads(engine: TransferEngine, peer: Peer) -> None:
    buf = np.zeros(64 * MiB, dtype=np.uint8)
    region = engine.register(buf, "write")
    src = MemoryRegionDescriptor.from_bytes(peer.descs["src"])
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        rng = random.Random(t)
        base = t * 4 * MiB
        try:
            futs = []
            for _ in range(40):
                off = rng.randrange(0, 4 * MiB - 65536)
                n = rng.randrange(1, 65536)
                futs.append(engine.read(region, base + off, n, src, base + off))
            futs.append(engine.read(region, base, 4 * MiB, src, base))
            for f in futs:
                f.result(60)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(90)
    assert not errors
    assert np.array_equal(buf, pattern(1, 64 * MiB))  # a prefix of the peer's source (same seed)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_peer_killed_mid_transfer(engine: TransferEngine, peer: Peer, provider: str) -> None:
    if provider == "shm" and libfabric_version() < (2, 5):
        pytest.skip(
            "shm before libfabric 2.5 (seen on 1.17): after a peer dies, a progress thread can block "
            "inside the provider (docs/transport.md)"
        )
    victim = start_peer(provider, [("src", 256 * MiB, "read")], domains=1, reorder=False)
    buf = np.zeros(256 * MiB, dtype=np.uint8)
    region = engine.register(buf, "write")
    try:
        futs = [engine.read(region, 0, 256 * MiB, victim.descs["src"], 0) for _ in range(8)]
        time.sleep(0.05)
        os.kill(victim.proc.pid or 0, signal.SIGKILL)
        start = time.monotonic()
        wait(futs, engine.timeout_s + 10)
        elapsed = time.monotonic() - start
        assert all(f.done() for f in futs), "futures hang after the peer died"
        assert elapsed < engine.timeout_s + 5
        failed = [f.exception() for f in futs if f.exception() is not None]
        assert failed, "no op failed although the peer was killed during the transfer"
        for exc in failed:
            assert isinstance(exc, PeerUnreachable), repr(exc)
            assert "read" in str(exc)
        later = engine.read(region, 0, 4096, victim.descs["src"], 0)  # new op to the dead peer
        with pytest.raises(TransferError, match="read"):
            later.result(engine.timeout_s + 10)
        # the engine still works with a live peer
        engine.read(region, 0, 8 * MiB, peer.descs["src"], 0).result(30)
        assert np.array_equal(buf[: 8 * MiB], pattern(1, 8 * MiB))
    finally:
        victim.proc.join(5)
        victim.conn.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(90)
def test_register_deregister_cycles_do_not_leak(engine: TransferEngine, peer: Peer) -> None:
    """A second thousand register/read/close cycles adds no fd or thread to the first thousand's.

    The baseline is taken after a first round, not before: a provider may open a connection once
    (tcp's rxm can add a socket for the peer's side after the first reads) without leaking.
    """
    buf = np.zeros(256 * 1024, dtype=np.uint8)

    def cycles() -> None:
        for i in range(1000):
            r = engine.register(buf, ("read", "write", "rw")[i % 3])
            if i % 100 == 0:
                engine.read(r, 0, 4096, peer.descs["src"], 0).result(30)
            r.close()

    cycles()
    fds, threads = _fds(), threading.active_count()
    cycles()
    assert _fds() <= fds
    assert threading.active_count() <= threads


@pytest.mark.timeout(60)
def test_out_of_range_and_wrong_access_refused(engine: TransferEngine, peer: Peer) -> None:
    buf = np.zeros(2 * MiB, dtype=np.uint8)
    region = engine.register(buf, "rw")
    ro = MemoryRegionDescriptor.from_bytes(peer.descs["ro"])
    with pytest.raises(RemoteAccessError, match="outside"):
        engine.read(region, 0, 4096, ro, ro.length - 100)
    with pytest.raises(RemoteAccessError, match="outside"):
        engine.read(region, 2 * MiB - 10, 4096, ro, 0)
    with pytest.raises(RemoteAccessError, match="outside"):
        engine.read(region, 0, 16, ro, -1)
    with pytest.raises(RemoteAccessError, match="not write"):
        engine.write(region, 0, 4096, ro, 0)
    with pytest.raises(RemoteAccessError, match="not write"):
        engine.write_imm(1, ro)
    with pytest.raises(RemoteAccessError, match="outside"):
        engine.write_paged(region, [0, 1], 4096, peer.descs["small"], [0, 4096], 4096, 4096)
    with pytest.raises(ValueError, match="32-bit"):
        engine.write(region, 0, 16, peer.descs["small"], 0, imm=2**32)
    local_ro = engine.register(buf, "read")
    with pytest.raises(RemoteAccessError, match="not read"):
        engine.read(
            region,
            0,
            16,
            MemoryRegionDescriptor.from_bytes(local_ro.descriptor.to_bytes()).__class__(
                address=local_ro.descriptor.address,
                keys=local_ro.descriptor.keys,
                base=local_ro.descriptor.base,
                length=local_ro.descriptor.length,
                access="write",
            ),
            0,
        )
    # nothing was posted: the peer's read-only bytes are unchanged and the engine still works
    assert peer.call("digest", "ro", 0, MiB) == digest(np.zeros(MiB, dtype=np.uint8))
    buf[:4096] = 1
    engine.read(region, 0, 4096, ro, 0).result(30)
    assert not buf[:4096].any()


@pytest.mark.timeout(60)
def test_forged_write_access_is_refused_by_provider(
    engine: TransferEngine, peer: Peer, provider: str
) -> None:
    """A read-only region's descriptor edited to claim write access must not let a write through.

    Where the provider does not check (shm before libfabric 2.5), the forged write lands: that
    is why rfork refuses read-only regions there (next test); this checks the version table is true.
    """
    buf = pattern(12, MiB).copy()
    region = engine.register(buf, "read")
    ro = MemoryRegionDescriptor.from_bytes(peer.descs["ro"])
    forged = MemoryRegionDescriptor(ro.address, ro.keys, ro.base, ro.length, "rw")
    fut = engine.write(region, 0, 4096, forged, 0)
    refused = False
    try:
        fut.result(10)
    except TransferError:
        refused = True
    zeros = digest(np.zeros(MiB, dtype=np.uint8))
    if refuses_forged_writes(provider):
        assert peer.call("digest", "ro", 0, MiB) == zeros, f"{provider} let a forged write through"
        # tcp fails the initiator's op; shm 2.5 drops the write but completes the op without error
        assert refused or provider == "shm", f"{provider} reported success for a refused write"
        return
    assert peer.call("digest", "ro", 0, MiB) != zeros, (
        f"{provider} on libfabric {libfabric_version()} refused the forged write: "
        "update refuses_forged_writes"
    )
    buf[:4096] = 0  # put the peer's region back as the other tests expect it
    engine.write(region, 0, 4096, forged, 0).result(10)
    assert peer.call("digest", "ro", 0, MiB) == zeros


@pytest.mark.timeout(60)
def test_a_refused_page_batch_fails_its_op_once_and_the_engine_goes_on(
    engine: TransferEngine, peer: Peer, provider: str
) -> None:
    """Every write of a gathered page batch refused at the target (a forged key to a read-only
    region): the op fails once, with the provider's refusal, within the timeout; nothing lands;
    the next batch on the same engine lands whole."""
    if provider == "shm":
        pytest.skip("shm does not report a refused write to the writer (1.17 lets it through, 2.5 drops it)")
    page = 16 << 10
    buf = pattern(13, 4 * MiB).copy()
    region = engine.register(buf, "read")
    ro = MemoryRegionDescriptor.from_bytes(peer.descs["ro"])
    forged = MemoryRegionDescriptor(ro.address, ro.keys, ro.base, ro.length, "rw")
    spans = [(p * page, q * page, page) for p, q in zip(random.Random(14).sample(range(256), 48),
                                                       random.Random(15).sample(range(64), 48), strict=True)]
    fut = engine.write_spans(region, spans, forged)
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        fut.result(engine.timeout_s + 10)
    assert time.monotonic() - t0 < engine.timeout_s + 5
    assert peer.call("digest", "ro", 0, MiB) == digest(np.zeros(MiB, dtype=np.uint8))
    peer.call("fill", "small", 0)
    remote = pattern(0, 16 * MiB).copy()
    engine.write_spans(region, spans, peer.descs["small"]).result(30)
    for lo, ro_off, n in spans:
        remote[ro_off : ro_off + n] = buf[lo : lo + n]
    assert peer.call("digest", "small", 0, 16 * MiB) == digest(remote)


@pytest.mark.timeout(60)
def test_forged_read_access_is_refused_by_provider(engine: TransferEngine, peer: Peer, provider: str) -> None:
    """A write-only region's descriptor edited to claim read access must not give its bytes away."""
    assert peer.call("fill", "wo", 13) is True
    buf = np.zeros(MiB, dtype=np.uint8)
    region = engine.register(buf, "write")
    wo = MemoryRegionDescriptor.from_bytes(peer.descs["wo"])
    forged = MemoryRegionDescriptor(wo.address, wo.keys, wo.base, wo.length, "rw")
    refused = False
    try:
        engine.read(region, 0, 4096, forged, 0).result(10)
    except TransferError:
        refused = True
    leaked = bool(np.array_equal(buf[:4096], pattern(13, 4096)))
    if refuses_forged_reads(provider):
        assert not leaked, f"{provider} on libfabric {libfabric_version()} let a forged read through"
        assert refused or provider == "shm", f"{provider} reported success for a refused read"
    else:
        # tcp (1.17 and 2.5.1) and shm 1.17 hand the bytes over: only the key guards a write-only region
        assert leaked, f"{provider} on libfabric {libfabric_version()} refused the forged read: update"


@pytest.mark.timeout(60)
def test_read_only_regions_refused_where_access_is_not_enforced(
    provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ALLOW_UNENFORCED_ENV, raising=False)
    with TransferEngine(provider, 1, timeout_s=8.0, **engine_kwargs(provider)) as eng:
        buf = np.zeros(MiB, dtype=np.uint8)
        for access in ("rw", "write"):
            eng.register(buf, access).close()
        if refuses_forged_writes(provider):
            eng.register(buf, "read").close()
            return
        with pytest.raises(BackendUnavailable, match=r"does not enforce remote access.*RFORK_LIBFABRIC_LIB"):
            eng.register(buf, "read")
        monkeypatch.setenv(ALLOW_UNENFORCED_ENV, "1")  # the trusted-host escape hatch
        eng.register(buf, "read").close()


@pytest.mark.timeout(60)
def test_messages_both_ways(engine: TransferEngine, peer: Peer, provider: str) -> None:
    got: list[Message] = []
    arrived = threading.Event()

    def on_msg(message: Message) -> None:
        got.append(message)
        if len(got) == 3:
            arrived.set()

    channel = engine.channel("conformance")
    channel.on_message(on_msg)
    # shm before 2.5 (seen on 1.17) moves sends above its 4 KiB inline size through a path that stalls
    big = provider != "shm" or libfabric_version() >= (2, 5)
    payloads = [b"x", b"hello" * (1000 if big else 100), bytes(range(256)) * (200 if big else 10)]
    for payload in payloads:
        assert peer.call("send", engine.address, "conformance", "data", payload) is True
    assert arrived.wait(10)
    assert [m.data for m in got] == payloads
    assert {(m.channel, m.kind, m.sender) for m in got} == {("conformance", "data", peer.address)}
    for payload in payloads:  # and the other way
        channel.send(peer.address, "back", payload).result(10)
    back = peer.call("inbox", "conformance", 3, 10)
    assert [(k, d) for k, d, _ in back] == [("back", p) for p in payloads]
    assert {s for _, _, s in back} == {engine.address}
    channel.close()


def _post_gather_write(dom: Any, pieces: list[tuple[int, int]], desc: Any, peer: int, raddr: int, key: int,
                       ctx: int, flags: int) -> Any:
    """One fi_writemsg with one local iov per (ptr, length) into one remote span; returns its keepalive."""
    from backends.providers._native import ffi, lib

    n = len(pieces)
    iov, descs = ffi.new("struct iovec[]", n), ffi.new("void *[]", n)
    for i, (ptr, length) in enumerate(pieces):
        iov[i].iov_base, iov[i].iov_len = ffi.cast("void *", ptr), length
        descs[i] = ffi.NULL if desc is None else desc
    riov, msg = ffi.new("struct fi_rma_iov *"), ffi.new("struct fi_msg_rma *")
    riov.addr, riov.len, riov.key = raddr, sum(length for _, length in pieces), key
    msg.msg_iov, msg.desc, msg.iov_count, msg.addr = iov, descs, n, peer
    msg.rma_iov, msg.rma_iov_count, msg.context = riov, 1, ffi.cast("void *", ctx)
    while True:
        rc = lib.fi_writemsg(dom._ep, msg, flags)
        if rc != -lib.FI_EAGAIN:
            break
        dom.poll()
    assert rc == 0, f"fi_writemsg returned {rc}"
    return (iov, descs, riov, msg)


@pytest.mark.timeout(90)
def test_multi_iov_local_writes_land_byte_for_byte(peer: Peer, provider: str) -> None:
    """Gather writes (2-4 local iovs, 16 in flight) into the peer's region, checked byte for byte.

    docs/transport.md once recorded wrong bytes from multi-iov local writes on 1.17; this pins what
    the provider itself does, on every version CI runs, before rfork relies on it.
    """
    from backends.descriptor import EngineAddress
    from backends.providers._native import buffer_address, lib
    from backends.providers.libfabric import LibfabricDomain

    # as the engine posts: delivery-complete on tcp, plain on shm (on 1.17, 15 of 20 multi-iov
    # delivery-complete writes to an engine peer never completed)
    flags = lib.FI_COMPLETION | (lib.FI_DELIVERY_COMPLETE if provider != "shm" else 0)

    dom = LibfabricDomain(provider, host="127.0.0.1" if provider == "tcp" else None)
    try:
        src = pattern(21, 4 * MiB).copy()
        sptr, snbytes, _keep = buffer_address(src)
        reg = dom.register(sptr, snbytes, remote_read=False, remote_write=False)
        small = MemoryRegionDescriptor.from_bytes(peer.descs["small"])
        target = dom.insert_peer(EngineAddress.from_bytes(small.address).domains[0])
        rng = random.Random(22)
        peer.call("fill", "small", 0)
        remote = pattern(0, 16 * MiB).copy()
        keep, in_flight, offset = [], 0, 0
        for ctx, (n_iov, page) in enumerate([(2, 4096), (4, 4096), (4, 65536), (3, 12345), (4, 1000)] * 4, 1):
            pages = rng.sample(range(snbytes // page), n_iov)
            pieces = [(sptr + p * page, page) for p in pages]
            raddr = small.base + offset
            keep.append(_post_gather_write(dom, pieces, reg.desc, target, raddr, small.keys[0], ctx, flags))
            for p in pages:
                remote[offset : offset + page] = src[p * page : (p + 1) * page]
                offset += page
            in_flight += 1
        deadline = time.monotonic() + 30
        while in_flight and time.monotonic() < deadline:
            for c in dom.wait(0.01):
                assert not c.error, c.message
                in_flight -= 1
        assert not in_flight, f"{in_flight} gather writes never completed"
        # shm's small (inject) writes land at the target's next progress, just after they complete here
        want = digest(remote)
        wait_until(lambda: peer.call("digest", "small", 0, 16 * MiB) == want, 5,
                   "multi-iov writes leave the right bytes at the target", every_s=0.1)
        dom.deregister(reg)
    finally:
        dom.close()
