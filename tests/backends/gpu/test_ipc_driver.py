"""The cuda-python driver backend of cuda-ipc (backends.gpu.driver, ipc_backends.DriverCudaIpc) run
on CPU over a fake driver (tests/backends/gpu/fake_driver.py), and the descriptor's wire format
fuzzed: only the CUDA calls themselves are left for the GPU tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.errors import TransferError
from backends.gpu.cuda_ipc import CudaIpcDescriptor, CudaIpcEngine, IpcExport, PeerGone, host_id
from backends.gpu.driver import Driver, DriverError
from backends.gpu.ipc_backends import DeviceSpan, DriverCudaIpc
from tests.backends.gpu.fake_driver import FakeDriver


@pytest.fixture
def fake() -> FakeDriver:
    return FakeDriver()


def _engines(fake: FakeDriver) -> tuple[CudaIpcEngine, CudaIpcEngine]:
    driver = Driver(fake)
    return (CudaIpcEngine(backend=DriverCudaIpc(driver=driver)),
            CudaIpcEngine(backend=DriverCudaIpc(driver=driver)))


def _elsewhere(desc: CudaIpcDescriptor) -> bytes:
    """The descriptor as if another process owned it (forces the open path)."""
    return dataclasses.replace(desc, owner_pid=desc.owner_pid + 100_000).to_bytes()


def test_export_names_the_whole_allocation_and_the_open_reads_at_the_right_offset(fake: FakeDriver) -> None:
    alloc = fake.malloc(1 << 16)
    gen = torch.Generator().manual_seed(3)
    alloc.copy_(torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=gen))
    weights = alloc[8192:].view(torch.bfloat16)[100:]  # a storage inside the allocation, a view inside it
    seed, loader = _engines(fake)
    with seed, loader:
        region = seed.register(weights, "read")
        d = region.descriptor
        assert d.exporter == "driver"
        assert d.ipc.storage_offset == 0
        assert d.ipc.storage_size == 1 << 16
        assert d.region_offset == 8192 + 200
        assert d.ipc.ref_counter_handle == b""
        assert not d.ipc.event_sync_required
        dst = fake.malloc(4096)
        dreg = loader.register(dst, "write")
        loader.read(dreg, 0, 4000, _elsewhere(d), 50).result(5)
        assert torch.equal(dst[:4000], alloc[8192 + 200 + 50:8192 + 200 + 50 + 4000])
        loader.read(dreg, 0, 10, _elsewhere(d), 0).result(5)
        assert sum(fake.open_count.values()) == 1  # opened once per region, then cached
    assert sum(fake.open_count.values()) == 0  # close unmapped it
    assert fake.live_events == set()  # every caller and completion event released


def test_copies_wait_on_an_event_recorded_on_the_submitting_thread(fake: FakeDriver) -> None:
    alloc = fake.malloc(4096)
    seed, loader = _engines(fake)
    with seed, loader:
        remote = _elsewhere(seed.register(alloc, "read").descriptor)
        dreg = loader.register(fake.malloc(4096), "write")
        fake.log.clear()
        loader.read(dreg, 0, 4096, remote, 0).result(5)
        records = [e for e in fake.log if e[0] == "record"]
        caller_ev, _caller_stream, thread, _ = records[0][1], records[0][2], records[0][3], None
        assert thread == threading.get_ident()  # recorded at submission, on the caller's thread
        waits = [e for e in fake.log if e[0] == "wait"]
        copies = [e for e in fake.log if e[0] == "copy"]
        assert waits[0][2] == caller_ev
        assert waits[0][1] == copies[0][4]
        assert fake.log.index(waits[0]) < fake.log.index(copies[0])


def test_open_of_a_handle_nobody_exports_is_peer_gone(fake: FakeDriver) -> None:
    alloc = fake.malloc(4096)
    seed, loader = _engines(fake)
    with seed, loader:
        d = seed.register(alloc, "read").descriptor
        gone = dataclasses.replace(d, owner_pid=1, ipc=d.ipc._replace(handle=b"\x07" * 64))
        dreg = loader.register(fake.malloc(64), "write")
        with pytest.raises(PeerGone, match="CUDA_ERROR_INVALID_HANDLE"):
            loader.read(dreg, 0, 64, gone, 0).result(5)


def test_export_of_memory_outside_any_allocation_names_the_driver_call(fake: FakeDriver) -> None:
    seed, _loader = _engines(fake)
    with seed, _loader:
        region = seed.register(torch.zeros(64, dtype=torch.uint8), "read")  # not from fake.malloc
        with pytest.raises(DriverError, match="cuMemGetAddressRange failed: CUDA_ERROR_INVALID_VALUE"):
            _ = region.descriptor


def test_every_driver_call_runs_with_a_context_pushed_and_popped(fake: FakeDriver) -> None:
    driver = Driver(fake)
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_CONTEXT"):
        driver.address_range(0)  # outside on(): the fake, like the driver, has no current context
    with driver.on(0):
        assert driver.stream_create() > 0
    assert fake._stack() == []
    with pytest.raises(DriverError, match="cuDeviceGet failed"):
        driver.on(3).__enter__()


def test_ipc_open_refuses_a_handle_of_the_wrong_size(fake: FakeDriver) -> None:
    with Driver(fake).on(0), pytest.raises(ValueError, match="64 bytes"):
        Driver(fake).ipc_open(b"short")


def test_device_span_slices_like_flat_bytes() -> None:
    s = DeviceSpan(0x1000, 100, owner="m")
    assert (s[10:30].ptr, s[10:30].nbytes, s[10:30].owner) == (0x100A, 20, "m")
    assert s[90:200].nbytes == 10
    assert s[50:40].nbytes == 0
    with pytest.raises(ValueError, match="step 1"):
        _ = s[::2]


# ---------------------------------------------------------------- the wire format, fuzzed

descriptors = st.builds(
    CudaIpcDescriptor,
    host=st.text(max_size=60),
    owner_pid=st.integers(-(2**63), 2**63 - 1),
    key=st.integers(0, 2**63 - 1),
    device=st.integers(-(2**31), 2**31 - 1),
    access=st.sampled_from(["read", "write", "rw"]),
    length=st.integers(0, 2**64 - 1),
    region_offset=st.integers(0, 2**64 - 1),
    ipc=st.builds(IpcExport, st.binary(min_size=64, max_size=64), st.integers(0, 2**64 - 1),
                  st.integers(0, 2**64 - 1), st.binary(max_size=40), st.integers(0, 2**64 - 1),
                  st.binary(max_size=64), st.booleans()),
    device_uuid=st.text(max_size=40),
    exporter=st.sampled_from(["torch", "driver"]),
)


@given(descriptors)
@settings(max_examples=200, deadline=None)
def test_descriptor_round_trips(d: CudaIpcDescriptor) -> None:
    assert CudaIpcDescriptor.from_bytes(d.to_bytes()) == d


@given(descriptors, st.data())
@settings(max_examples=300, deadline=None)
def test_garbled_descriptors_raise_transfer_error_only(d: CudaIpcDescriptor, data: st.DataObject) -> None:
    blob = bytearray(d.to_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    for candidate in (bytes(blob), bytes(blob[:cut])):
        with contextlib.suppress(TransferError):
            CudaIpcDescriptor.from_bytes(candidate)


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_arbitrary_bytes_are_refused_cleanly(blob: bytes) -> None:
    with contextlib.suppress(TransferError):
        CudaIpcDescriptor.from_bytes(blob)


def test_descriptor_from_another_host_is_refused_before_any_open(fake: FakeDriver) -> None:
    seed, loader = _engines(fake)
    with seed, loader:
        d = seed.register(fake.malloc(64), "read").descriptor
        assert d.host == host_id()
        dreg = loader.register(fake.malloc(64), "write")
        with pytest.raises(TransferError, match="only works between processes of one host"):
            loader.read(dreg, 0, 64, dataclasses.replace(d, host="other/boot"), 0)
    assert fake.open_count == {}


def test_cuda_ipc_needs_no_libfabric_binding() -> None:
    """CUDA IPC moves device memory without the transport: it must import where the binding did not
    build (a GPU machine without the headers), and fail there only on its own terms."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['backends.providers._libfabric'] = None\n"
            "import backends.gpu.cuda_ipc, backends.gpu.ipc_backends, backends.gpu.driver\n"
            "print('imported')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "imported"
