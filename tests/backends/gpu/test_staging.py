"""Staging pipeline: ordering and failure logic with fake steps, then real tcp loopback engines.

CPU tensors stand in for device memory (pinned bounce buffers only when CUDA exists). The CUDA
stream/event path of backends.gpu.staging is not run here; see docs/gpu.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch

from backends.errors import PeerUnreachable, RemoteAccessError, TransferError
from backends.gpu.staging import (
    Chunk,
    StagedReader,
    StagedWriter,
    StagingError,
    byte_view,
    plan_chunks,
    run_read_pipeline,
    run_write_pipeline,
)

os.environ.setdefault("FI_TCP_IFACE", "lo")


# ---------------------------------------------------------------- pipeline logic with fake steps


class _Copy:
    def __init__(self, log: list[tuple[str, int]], slot: int) -> None:
        self.log, self.slot, self.synced = log, slot, False

    def synchronize(self) -> None:
        if not self.synced:
            self.synced = True
            self.log.append(("sync", self.slot))


def _done(exc: BaseException | None = None) -> Future[None]:
    f: Future[None] = Future()
    if exc is None:
        f.set_result(None)
    else:
        f.set_exception(exc)
    return f


def test_plan_chunks_covers_range() -> None:
    chunks = plan_chunks(10, 25, 100, 8)
    assert [(c.offset, c.remote_offset, c.length) for c in chunks] == [
        (10, 100, 8), (18, 108, 8), (26, 116, 8), (34, 124, 1)]
    assert [c.index for c in chunks] == [0, 1, 2, 3]
    assert plan_chunks(0, 0, 0, 8) == []
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan_chunks(0, 1, 0, 0)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_read_pipeline_order_and_slot_reuse(depth: int) -> None:
    """Each chunk: fetched, then copied out; a slot is refetched only after its copy synchronized."""
    log: list[tuple[str, int]] = []
    outstanding: list[Future[None]] = []
    copies: dict[int, _Copy] = {}
    max_inflight = 0

    def fetch(slot: int, n: int, roff: int) -> Future[None]:
        nonlocal max_inflight
        prior = copies.get(slot)
        assert prior is None or prior.synced, "slot refilled before its device copy finished"
        log.append(("fetch", roff))
        f = _done()
        outstanding.append(f)
        max_inflight = max(max_inflight, len(outstanding))
        return f

    def to_device(slot: int, n: int, off: int) -> _Copy:
        outstanding.pop(0)
        log.append(("copy", off))
        copies[slot] = _Copy(log, slot)
        return copies[slot]

    chunks = plan_chunks(0, 70, 1000, 10)
    assert run_read_pipeline(chunks, depth=depth, fetch=fetch, to_device=to_device) == 70
    assert max_inflight == depth
    fetched = [v for k, v in log if k == "fetch"]
    copied = [v for k, v in log if k == "copy"]
    assert fetched == [1000 + 10 * i for i in range(7)]
    assert copied == [10 * i for i in range(7)]
    for i in range(7):  # copy of chunk i comes after its fetch
        assert log.index(("fetch", 1000 + 10 * i)) < log.index(("copy", 10 * i))
    assert all(c.synced for c in copies.values())


def test_read_pipeline_network_failure_reports_progress() -> None:
    drained: list[int] = []

    def fetch(slot: int, n: int, roff: int) -> Future[None]:
        if roff == 30:
            return _done(PeerUnreachable("read with peer tcp:x failed: reset"))
        f = _done()
        f.add_done_callback(lambda _f: drained.append(roff))
        return f

    with pytest.raises(StagingError, match=r"network read of chunk 3 .*after 30 bytes") as ei:
        run_read_pipeline(plan_chunks(0, 80, 0, 10), depth=2, fetch=fetch,
                          to_device=lambda s, n, o: _Copy([], s))
    assert ei.value.bytes_done == 30
    assert isinstance(ei.value, TransferError)
    assert isinstance(ei.value.__cause__, PeerUnreachable)


def test_read_pipeline_copy_failure_and_synchronous_fetch_error() -> None:
    def bad_copy(slot: int, n: int, off: int) -> _Copy:
        if off == 20:
            raise RuntimeError("CUDA error: an illegal memory access")
        return _Copy([], slot)

    with pytest.raises(StagingError, match="device copy of chunk 2") as ei:
        run_read_pipeline(plan_chunks(0, 50, 0, 10), depth=2, fetch=lambda s, n, r: _done(),
                          to_device=bad_copy)
    assert ei.value.bytes_done == 20

    def raising_fetch(slot: int, n: int, roff: int) -> Future[None]:
        raise RemoteAccessError("read: remote range outside")

    with pytest.raises(StagingError, match="network read of chunk 0") as ei2:
        run_read_pipeline(plan_chunks(0, 50, 0, 10), depth=2, fetch=raising_fetch,
                          to_device=lambda s, n, o: _Copy([], s))
    assert ei2.value.bytes_done == 0


def test_write_pipeline_copy_then_send() -> None:
    log: list[tuple[str, int]] = []
    live: dict[int, Future[None]] = {}

    def from_device(slot: int, n: int, off: int) -> _Copy:
        assert slot not in live or live[slot].done(), "slot overwritten while its send is in flight"
        log.append(("copy", off))
        return _Copy(log, slot)

    def send(slot: int, n: int, roff: int) -> Future[None]:
        assert log[-1][0] == "sync", "sent before the device copy completed"
        log.append(("send", roff))
        live[slot] = _done()
        return live[slot]

    assert run_write_pipeline(plan_chunks(5, 45, 0, 10), depth=2, from_device=from_device, send=send) == 45
    assert [v for k, v in log if k == "send"] == [0, 10, 20, 30, 40]

    def failing_send(slot: int, n: int, roff: int) -> Future[None]:
        return _done(PeerUnreachable("write failed")) if roff == 20 else _done()

    with pytest.raises(StagingError, match=r"network write of chunk 2 .*after 20 bytes") as ei:
        run_write_pipeline(plan_chunks(0, 50, 0, 10), depth=2, from_device=lambda s, n, o: _Copy([], s),
                           send=failing_send)
    assert ei.value.bytes_done == 20


def test_pipeline_rejects_bad_depth() -> None:
    with pytest.raises(ValueError, match="depth"):
        run_read_pipeline([Chunk(0, 0, 0, 1)], depth=0, fetch=lambda s, n, r: _done(),
                          to_device=lambda s, n, o: _Copy([], s))


def test_byte_view() -> None:
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    assert byte_view(t).numel() == 12
    with pytest.raises(TransferError, match="contiguous"):
        byte_view(t.t())


# ---------------------------------------------------------------- real tcp loopback engines


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[object, object]]:
    from backends import TransferEngine, provider_available

    if not provider_available("tcp", "127.0.0.1"):
        pytest.skip("libfabric tcp provider is not available")
    with TransferEngine("tcp", 1, timeout_s=2.0, host="127.0.0.1") as seed, \
            TransferEngine("tcp", 2, timeout_s=2.0, host="127.0.0.1", reorder_for_test=True) as loader:
        yield seed, loader


def _pattern(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.timeout(60)
def test_staged_read_over_tcp_byte_exact(engines: tuple) -> None:
    seed, loader = engines
    src = _pattern(3 << 20, 1)
    region = seed.register(src, "read")
    try:
        dst = torch.zeros((3 << 20) // 2 + 8, dtype=torch.bfloat16)  # the "device" tensor
        with StagedReader(loader, bounce_bytes=64 << 10, depth=2) as rd:
            n = (3 << 20) - 12345
            assert rd.read_into(dst, 6, n, region.descriptor.to_bytes(), 7).result(30) == n
            got = byte_view(dst)
            assert torch.equal(got[6:6 + n], src[7:7 + n])
            assert int(got[:6].count_nonzero()) == 0
            assert int(got[6 + n:].count_nonzero()) == 0
            # zero-length and a second op on the same reader
            assert rd.read_into(dst, 0, 0, region.descriptor, 0).result(5) == 0
            assert rd.read_into(dst, 0, 100, region.descriptor, 0).result(5) == 100
            assert torch.equal(byte_view(dst)[:100], src[:100])
    finally:
        seed.deregister(region)


@pytest.mark.timeout(60)
def test_staged_write_over_tcp_byte_exact(engines: tuple) -> None:
    seed, loader = engines
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    region = seed.register(dst, "write")
    try:
        src = _pattern((1 << 20) - 100, 2).view(torch.int16)  # the "device" tensor
        with StagedWriter(loader, bounce_bytes=32 << 10, depth=3) as wr:
            assert wr.write_from(src, 0, src.numel() * 2, region.descriptor, 50).result(30) == src.numel() * 2
        assert torch.equal(dst[50:50 + src.numel() * 2], byte_view(src))
    finally:
        seed.deregister(region)


@pytest.mark.timeout(30)
def test_staged_range_and_access_errors_before_any_byte(engines: tuple) -> None:
    seed, loader = engines
    src = _pattern(1 << 16, 3)
    region = seed.register(src, "read")
    try:
        dst = torch.zeros(1 << 16, dtype=torch.uint8)
        with StagedReader(loader, bounce_bytes=4096) as rd, StagedWriter(loader, bounce_bytes=4096) as wr:
            with pytest.raises(RemoteAccessError, match="outside the 65536-byte region"):
                rd.read_into(dst, 0, 4096, region.descriptor, (1 << 16) - 10)
            with pytest.raises(RemoteAccessError, match="destination range"):
                rd.read_into(dst, 10, 1 << 16, region.descriptor, 0)
            with pytest.raises(RemoteAccessError, match="not write"):
                wr.write_from(dst, 0, 16, region.descriptor, 0)
        assert int(dst.count_nonzero()) == 0
    finally:
        seed.deregister(region)


@pytest.mark.timeout(30)
def test_staged_read_from_dead_peer_fails_clearly() -> None:
    from backends import TransferEngine, provider_available

    if not provider_available("tcp", "127.0.0.1"):
        pytest.skip("libfabric tcp provider is not available")
    with TransferEngine("tcp", 1, timeout_s=1.0, host="127.0.0.1") as loader:
        seed = TransferEngine("tcp", 1, timeout_s=1.0, host="127.0.0.1")
        src = _pattern(1 << 20, 4)
        desc = seed.register(src, "read").descriptor
        seed.close()
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        with StagedReader(loader, bounce_bytes=64 << 10) as rd:
            fut = rd.read_into(dst, 0, 1 << 20, desc, 0)
            msg = "staged read of 1048576 bytes: network read of chunk 0"
            with pytest.raises(StagingError, match=msg) as ei:
                fut.result(20)
            assert ei.value.bytes_done == 0
            assert isinstance(ei.value.__cause__, PeerUnreachable)


# ---------------------------------------------------------------- GPU (skipped where CUDA is absent)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(60)
def test_gpu_staged_read_and_write_through_pinned_slots(engines: tuple) -> None:
    """tcp into and out of device memory: the bounce slots are pinned, the copies run on a side stream
    after the caller's queued work (a fill of the destination just before the read must not land
    over the read's bytes), and the future resolves with the bytes in place."""
    seed, loader = engines
    n = 64 << 20
    src = _pattern(n, 5)
    region = seed.register(src, "read")
    back = torch.zeros(n, dtype=torch.uint8)
    wregion = seed.register(back, "write")
    try:
        dst = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda")
        dst.view(torch.uint8).fill_(0xAB)  # queued on the caller's stream, not yet run maybe
        with StagedReader(loader, bounce_bytes=4 << 20, depth=3, device=dst.device) as rd, \
                StagedWriter(loader, bounce_bytes=4 << 20, depth=2, device=dst.device) as wr:
            assert rd._bounce.is_pinned()
            assert rd.read_into(dst, 0, n, region.descriptor, 0).result(60) == n
            assert torch.equal(byte_view(dst).cpu(), src)
            dst.view(torch.uint8)[:4096].fill_(7)  # queued; the write must send these bytes
            assert wr.write_from(dst, 0, n, wregion.descriptor, 0).result(60) == n
        assert torch.equal(back[:4096], torch.full((4096,), 7, dtype=torch.uint8))
        assert torch.equal(back[4096:], src[4096:])
        with StagedReader(loader, bounce_bytes=4096, device="cuda:0") as rd, \
                pytest.raises(TransferError, match="contiguous"):
            rd.read_into(dst.view(2, -1).t(), 0, 16, region.descriptor, 0)
    finally:
        seed.deregister(region)
        seed.deregister(wregion)
