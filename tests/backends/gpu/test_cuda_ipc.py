"""CUDA IPC provider: descriptor format, checks and engine logic on CPU (a stand-in backend), and the
real GPU tests (marked gpu; skipped with a reason where CUDA is absent, as on the machines this was
written on: they have not been run yet, see docs/gpu.md).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import secrets
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from backends.errors import BackendUnavailable, EngineClosed, RemoteAccessError, TransferError
from backends.gpu.cuda_ipc import (
    CudaIpcDescriptor,
    CudaIpcEngine,
    IpcExport,
    PeerGone,
    host_id,
)
from tests.backends.peer import digest

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is false)")


# ---------------------------------------------------------------- CPU: format and checks


def _desc(**kw: object) -> CudaIpcDescriptor:
    ipc = IpcExport(b"\x01" * 64, 1 << 20, 512, b"/torch_123_456", 7, b"\x02" * 64, True)
    base: dict = {"host": host_id(), "owner_pid": 4242, "key": 2**62 + 5, "device": 1, "access": "read",
                  "length": 4096, "region_offset": 1024, "ipc": ipc}
    base.update(kw)
    return CudaIpcDescriptor(**base)


@pytest.mark.parametrize("access", ["read", "write", "rw"])
def test_descriptor_round_trip(access: str) -> None:
    d = _desc(access=access)
    assert CudaIpcDescriptor.from_bytes(d.to_bytes()) == d
    empty_event = _desc(ipc=d.ipc._replace(event_handle=b"", event_sync_required=False))
    assert CudaIpcDescriptor.from_bytes(empty_event.to_bytes()) == empty_event


def test_a_torch_handle_is_opaque_a_driver_handle_is_64_bytes() -> None:
    # torch 2.11's _share_cuda_ handle is 66 bytes (a version and a kind byte, then the 64-byte handle):
    # the first GPU run refused every torch export as "not 64 bytes"
    torch_style = _desc(ipc=_desc().ipc._replace(handle=b"\x01c" + b"\x01" * 64))
    assert CudaIpcDescriptor.from_bytes(torch_style.to_bytes()) == torch_style
    driver_style = dataclasses.replace(torch_style, exporter="driver")
    with pytest.raises(TransferError, match="IPC handle of 66 bytes, not 64"):
        CudaIpcDescriptor.from_bytes(driver_style.to_bytes())


def test_descriptor_rejects_garbage() -> None:
    blob = _desc().to_bytes()
    for bad in (b"", b"RFMR" + blob[4:], blob[:-1], blob + b"x", blob[:40]):
        with pytest.raises(TransferError, match="not an rfork CUDA IPC descriptor"):
            CudaIpcDescriptor.from_bytes(bad)
    with pytest.raises(TransferError, match="access"):
        _desc(access="exec")


@pytest.mark.skipif(HAS_CUDA, reason="checks the error raised where CUDA is absent")
def test_needs_cuda_error_without_gpu() -> None:
    with pytest.raises(BackendUnavailable, match="CUDA IPC needs a CUDA device"):
        CudaIpcEngine()


class _Done:
    def synchronize(self) -> None:
        return None


class CpuStandIn:
    """The IpcBackend steps on CPU tensors: export hands out a random handle, open looks it up.

    Its one "GPU" has UUID `uuid`; caller_event names the submitting thread, and copy records which
    event each copy was ordered after (the real backend makes its copy stream wait on it)."""

    name = "torch"

    def __init__(self, uuid: str = "GPU-standin-0") -> None:
        self.exports: dict[bytes, torch.Tensor] = {}
        self.opens = 0
        self.fail_copy = False
        self.uuid = uuid
        self.copied_after: list[object] = []

    def check_tensor(self, tensor: torch.Tensor) -> int:
        if tensor.device.type != "cpu":
            raise TransferError("stand-in takes CPU tensors")
        return 0

    def device_uuid(self, index: int) -> str:
        assert index == 0
        return self.uuid

    def local_index(self, uuid: str) -> int:
        if uuid != self.uuid:
            raise TransferError(f"GPU {uuid} is not visible in this process (CUDA_VISIBLE_DEVICES?)")
        return 0

    def caller_event(self) -> object:
        return ("event recorded on the stream of thread", threading.get_ident())

    def export(self, tensor: torch.Tensor) -> IpcExport:
        storage = tensor.untyped_storage()
        whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        handle = secrets.token_bytes(64)
        self.exports[handle] = whole
        return IpcExport(handle, storage.nbytes(), 0, b"rc", 0, b"", False)

    def open(self, desc: CudaIpcDescriptor, index: int) -> Any:
        assert index == 0
        self.opens += 1
        if desc.ipc.handle not in self.exports:
            raise RuntimeError("invalid resource handle")
        return self.exports[desc.ipc.handle]

    def copy(self, dst: Any, src: Any, after: object) -> _Done:
        self.copied_after.append(after)
        if self.fail_copy:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        dst.copy_(src)
        return _Done()

    def close(self) -> None:
        return None


@pytest.fixture
def pair() -> Iterator[tuple[CudaIpcEngine, CudaIpcEngine, CpuStandIn]]:
    backend = CpuStandIn()
    with CudaIpcEngine(backend=backend) as seed, CudaIpcEngine(backend=backend) as loader:
        yield seed, loader, backend


def _as_other_process(d: CudaIpcDescriptor) -> bytes:
    return dataclasses.replace(d, owner_pid=d.owner_pid + 100_000).to_bytes()


def test_standin_read_write_through_open_path(pair: tuple) -> None:
    seed, loader, backend = pair
    big = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    weights = big[4096:].view(torch.int32)  # a view with a storage offset
    region = seed.register(weights, "rw")
    assert region.descriptor.region_offset == 4096
    assert region.descriptor.length == (1 << 16) - 4096
    remote = _as_other_process(region.descriptor)
    dst = torch.zeros(1 << 16, dtype=torch.uint8)
    dreg = loader.register(dst, "write")
    loader.read(dreg, 10, 5000, remote, 3).result(5)
    assert torch.equal(dst[10:5010], big[4096 + 3:4096 + 5003])
    loader.read(dreg, 0, 10, remote, 0).result(5)
    assert backend.opens == 1  # opened once, then cached
    dst[:100] = 7
    loader.write(dreg, 0, 100, remote, 200).result(5)
    assert torch.equal(big[4096 + 200:4096 + 300], torch.full((100,), 7, dtype=torch.uint8))


def test_write_only_destination_is_never_exported(pair: tuple) -> None:
    seed, loader, backend = pair
    src = seed.register(torch.arange(256, dtype=torch.uint8), "read")
    remote = _as_other_process(src.descriptor)  # asking for the descriptor exports (once)
    assert src.exported
    assert len(backend.exports) == 1
    dst = torch.zeros(256, dtype=torch.uint8)
    dreg = loader.register(dst, "write")
    loader.read(dreg, 0, 256, remote, 0).result(5)
    assert torch.equal(dst, torch.arange(256, dtype=torch.uint8))
    assert not dreg.exported  # a local destination: no _share_cuda_
    assert len(backend.exports) == 1


def test_descriptor_names_the_gpu_by_uuid_and_opener_maps_it(pair: tuple) -> None:
    seed, loader, backend = pair
    region = seed.register(torch.ones(64, dtype=torch.uint8), "read")
    assert region.descriptor.device_uuid == "GPU-standin-0"
    dreg = loader.register(torch.zeros(64, dtype=torch.uint8), "write")
    elsewhere = dataclasses.replace(_desc_of(region), device_uuid="GPU-not-here")
    with pytest.raises(TransferError, match="GPU-not-here is not visible in this process"):
        loader.read(dreg, 0, 64, elsewhere.to_bytes(), 0).result(5)
    assert backend.opens == 0


def test_copies_wait_on_an_event_from_the_submitting_thread(pair: tuple) -> None:
    seed, loader, backend = pair
    region = seed.register(torch.ones(64, dtype=torch.uint8), "read")
    dreg = loader.register(torch.zeros(64, dtype=torch.uint8), "write")
    remote = _as_other_process(region.descriptor)
    loader.read(dreg, 0, 64, remote, 0).result(5)

    def submit_elsewhere() -> None:
        loader.read(dreg, 0, 32, remote, 0).result(5)

    t = threading.Thread(target=submit_elsewhere)
    t.start()
    t.join(10)
    assert [a[1] for a in backend.copied_after] == [threading.get_ident(), t.ident]  # not the launcher's


def _desc_of(region) -> CudaIpcDescriptor:
    return dataclasses.replace(region.descriptor, owner_pid=region.descriptor.owner_pid + 100_000)


def test_standin_same_process_uses_local_table(pair: tuple) -> None:
    seed, loader, backend = pair
    src = torch.arange(1000, dtype=torch.int64)
    region = seed.register(src, "read")
    dst = torch.zeros(1000, dtype=torch.int64)
    dreg = loader.register(dst, "rw")
    loader.read(dreg, 0, 8000, region.descriptor.to_bytes(), 0).result(5)
    assert torch.equal(dst, src)
    assert backend.opens == 0
    seed.deregister(region)
    fut = loader.read(dreg, 0, 8, region.descriptor, 0)
    with pytest.raises(PeerGone, match="no longer registered"):
        fut.result(5)


def test_standin_checks_before_any_copy(pair: tuple) -> None:
    seed, loader, backend = pair
    src = torch.ones(4096, dtype=torch.uint8)
    ro = seed.register(src, "read").descriptor
    wo = seed.register(torch.ones(64, dtype=torch.uint8), "write").descriptor
    dst = torch.zeros(4096, dtype=torch.uint8)
    dreg = loader.register(dst, "rw")
    with pytest.raises(RemoteAccessError, match="outside the 4096-byte region"):
        loader.read(dreg, 0, 100, ro, 4000)
    with pytest.raises(RemoteAccessError, match="local range"):
        loader.read(dreg, 4000, 100, ro, 0)
    with pytest.raises(RemoteAccessError, match="not read"):
        loader.read(dreg, 0, 10, wo, 0)
    with pytest.raises(RemoteAccessError, match="not write"):
        loader.write(dreg, 0, 10, ro, 0)
    with pytest.raises(TransferError, match="only works between processes of one host"):
        loader.read(dreg, 0, 10, dataclasses.replace(ro, host="elsewhere/boot"), 0)
    lying = dataclasses.replace(ro, ipc=ro.ipc._replace(storage_size=100))
    with pytest.raises(TransferError, match="exceeds its 100-byte storage"):
        loader.read(dreg, 0, 10, lying, 0)
    with pytest.raises(TransferError, match="not contiguous"):
        seed.register(torch.zeros(8, 8).t(), "read")
    with pytest.raises(ValueError, match="access"):
        seed.register(src, "all")
    assert int(dst.count_nonzero()) == 0
    assert backend.opens == 0


def test_standin_failures_surface_in_future(pair: tuple) -> None:
    seed, loader, backend = pair
    region = seed.register(torch.ones(64, dtype=torch.uint8), "read")
    dreg = loader.register(torch.zeros(64, dtype=torch.uint8), "rw")
    backend.fail_copy = True
    with pytest.raises(TransferError, match="read with peer cuda-ipc:pid .* illegal memory access"):
        loader.read(dreg, 0, 64, region.descriptor, 0).result(5)
    backend.fail_copy = False
    ipc = region.descriptor.ipc._replace(handle=b"x")
    gone = dataclasses.replace(region.descriptor, owner_pid=1, ipc=ipc)
    with pytest.raises(PeerGone, match="opening the CUDA IPC handle of pid 1 failed"):
        loader.read(dreg, 0, 64, gone, 0).result(5)
    loader.close()
    with pytest.raises(EngineClosed):
        loader.read(dreg, 0, 64, region.descriptor, 0)


# ---------------------------------------------------------------- GPU (not run where CUDA is absent)

GIB = 1 << 30


def _backends() -> list[str]:
    from backends.gpu.driver import available

    return (["driver"] if available() else []) + ["torch"]


def _fill(t: torch.Tensor, seed: int) -> None:
    """Deterministic bytes on the GPU in 64 MiB slices (no host round trip)."""
    g = torch.Generator(device=t.device).manual_seed(seed)
    step = 64 << 20
    for k in range(0, t.numel(), step):
        n = min(step, t.numel() - k)
        t[k:k + n] = torch.randint(0, 256, (n,), dtype=torch.uint8, device=t.device, generator=g)


def _gpu_seed(conn: Connection, nbytes: int, backend: str, linger: bool) -> None:
    eng = CudaIpcEngine(backend=backend)
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    _fill(src, 11)
    region = eng.register(src[4096:], "read")  # a view: the region starts inside the allocation
    # plain bytes: a CPU tensor would travel as a shared-memory fd that dies with this process
    offsets = (0, nbytes // 3, nbytes - 8192)
    windows = [(o, src[4096 + o:4096 + o + 4096].cpu().numpy().tobytes()) for o in offsets]
    conn.send((region.descriptor.to_bytes(), digest(src[4096:].cpu().numpy()), windows))
    if linger:
        conn.recv()  # the loader is done: only now may the seed's memory go away
    eng.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", _backends())
def test_gpu_conformance_two_processes_1gib(backend: str) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_gpu_seed, args=(child, GIB, backend, True), daemon=True)
    proc.start()
    try:
        assert parent.poll(120), "seed process did not export within 120 s"
        blob, want, windows = parent.recv()
        desc = CudaIpcDescriptor.from_bytes(blob)
        assert desc.exporter == backend
        assert desc.region_offset == 4096
        n = GIB - 4096
        with CudaIpcEngine(backend=backend) as eng:
            dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
            dst.fill_(0xCD)  # queued on the caller's stream just before the reads: must come first
            reg = eng.register(dst, "write")
            eng.read(reg, 0, n // 2, blob, 0).result(120)
            eng.read(reg, n // 2, n - n // 2, blob, n // 2).result(120)  # two ops, one open
            assert digest(dst.cpu().numpy()) == want
            for off, cpu in windows:
                assert dst[off:off + 4096].cpu().numpy().tobytes() == cpu
            with pytest.raises(RemoteAccessError):
                eng.read(reg, 0, 4096, blob, n - 100)
            with pytest.raises(RemoteAccessError, match="not write"):
                eng.write(reg, 0, 4096, blob, 0)
        parent.send("done")
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", _backends())
def test_gpu_open_after_the_seed_exited_is_peer_gone(backend: str) -> None:
    """A seed that exits before the loader opened its handle: a clear PeerGone, within bounded time."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_gpu_seed, args=(child, 64 << 20, backend, False), daemon=True)
    proc.start()
    assert parent.poll(120), "seed process did not export within 120 s"
    blob, _want, _windows = parent.recv()
    proc.join(60)
    assert proc.exitcode == 0
    with CudaIpcEngine(backend=backend) as eng:
        reg = eng.register(torch.zeros(4096, dtype=torch.uint8, device="cuda"), "write")
        with pytest.raises(PeerGone, match="opening the CUDA IPC handle"):
            eng.read(reg, 0, 4096, blob, 0).result(60)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", _backends())
def test_gpu_same_process_read_and_registration_checks(backend: str) -> None:
    with CudaIpcEngine(backend=backend) as seed, CudaIpcEngine(backend=backend) as loader:
        src = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        _fill(src, 3)
        region = seed.register(src[1 << 20:], "read")
        dst = torch.zeros(16 << 20, dtype=torch.uint8, device="cuda")
        loader.read(loader.register(dst, "rw"), 0, 16 << 20, region.descriptor.to_bytes(), 5).result(60)
        assert torch.equal(dst, src[(1 << 20) + 5:(1 << 20) + 5 + (16 << 20)])
        with pytest.raises(TransferError, match="not a CUDA device"):
            seed.register(torch.zeros(8), "read")


@pytest.mark.gpu
@needs_cuda
def test_gpu_dmabuf_fd_of_device_memory() -> None:
    """A DMA-BUF file descriptor of a tensor's allocation (what a provider with FI_HMEM would register)."""
    import os

    from backends.gpu.driver import DriverError, available, shared_driver

    if not available():
        pytest.skip("cuda-python is not installed here")
    drv = shared_driver()
    index = torch.cuda.current_device()
    if not drv.dmabuf_supported(index):
        pytest.skip("no DMA-BUF descriptors from this GPU or driver (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)")
    t = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    with drv.on(index):
        base, size = drv.address_range(t.data_ptr())
        try:
            fd = drv.dmabuf_fd(base, size)
        except DriverError as exc:
            if exc.code != "CUDA_ERROR_NOT_SUPPORTED":
                raise
            pytest.skip(f"the driver reports DMA-BUF support but refuses the handle: {exc}")
    try:
        assert fd >= 0
        os.fstat(fd)
    finally:
        os.close(fd)
