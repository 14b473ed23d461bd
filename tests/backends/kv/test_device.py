"""KV pages in device memory over the host KV protocol (backends.kv.device), real tcp engines.

The device is a parameter: "cpu" runs the staging copies with CPU tensors standing in for device
memory (here), "cuda" the same test on a GPU (marked gpu). The CUDA run happens only on a GPU machine.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from backends import TransferEngine
from backends.gpu.host_copy import page_runs
from backends.kv.device import SLICE_RUNS, DeviceKvPool, DeviceKvReceiver, DeviceKvSender
from tests.backends.gpu.devices import DEVICES

LAYERS, PAGES, PAGE_BYTES = 3, 64, 4096


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    a = TransferEngine("tcp", 1, timeout_s=5.0, host="127.0.0.1", reorder_for_test=True)
    b = TransferEngine("tcp", 1, timeout_s=5.0, host="127.0.0.1", reorder_for_test=True)
    yield a, b
    a.close()
    b.close()


def _pools(engines: tuple[TransferEngine, TransferEngine], device: str) -> tuple[DeviceKvPool, DeviceKvPool]:
    nbytes = LAYERS * 2 * PAGES * PAGE_BYTES
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).to(device)
    dst = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device=device)  # any dtype: the pool is bytes
    a = DeviceKvPool(engines[0], layers=LAYERS, pages=PAGES, page_bytes=PAGE_BYTES, device_buffer=src)
    b = DeviceKvPool(engines[1], layers=LAYERS, pages=PAGES, page_bytes=PAGE_BYTES, device_buffer=dst)
    return a, b


def _page(pool: DeviceKvPool, layer: int, kv: int, page: int) -> torch.Tensor:
    off = pool.geometry.offset(layer, kv, page)
    return pool.device[off:off + PAGE_BYTES].cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["scattered", "runs"])
def test_device_pages_arrive_exactly_and_nothing_else_changes(
    engines: tuple[TransferEngine, TransferEngine], device: str, layout: str
) -> None:
    a, b = _pools(engines, device)
    sender, receiver = DeviceKvSender(a), DeviceKvReceiver(b, name="dev", timeout_s=10.0)
    try:
        receiver.join(sender.address)
        rng = random.Random(layout)
        if layout == "scattered":  # many runs: the gather/scatter path
            src_pages, dst_pages = rng.sample(range(PAGES), 40), rng.sample(range(PAGES), 40)
            assert len(page_runs(dst_pages)) > SLICE_RUNS
        else:  # a few runs: the slice path
            src_pages, dst_pages = [*range(5, 15), *range(30, 34)], [*range(40, 50), *range(0, 4)]
            assert len(page_runs(dst_pages)) <= SLICE_RUNS
        inc = receiver.request(sender.address, f"r-{layout}-{device}", dst_pages)
        out = sender.start(f"r-{layout}-{device}", src_pages)
        out.send_layer(0)
        inc.wait_layer(0, 10)  # layer 0 is on the device before the others were even sent
        for s, d in zip(src_pages, dst_pages, strict=True):
            assert torch.equal(_page(b, 0, 1, d), _page(a, 0, 1, s))
        out.send_all().wait(10)
        inc.wait(10)
        for layer in range(LAYERS):
            for kv in (0, 1):
                for s, d in zip(src_pages, dst_pages, strict=True):
                    assert torch.equal(_page(b, layer, kv, d), _page(a, layer, kv, s)), (layer, kv, s, d)
                untouched = set(range(PAGES)) - set(dst_pages)
                assert all(int(_page(b, layer, kv, p).count_nonzero()) == 0 for p in untouched)
    finally:
        sender.close()
        receiver.close()
        a.close()
        b.close()


def test_device_pool_checks_its_buffer(engines: tuple[TransferEngine, TransferEngine]) -> None:
    with pytest.raises(ValueError, match="geometry needs"):
        DeviceKvPool(
            engines[0], layers=1, pages=2, page_bytes=4096, device_buffer=torch.zeros(100, dtype=torch.uint8)
        )


@given(st.lists(st.integers(0, 50), max_size=60))
def test_page_runs_cover_the_pages_in_order(pages: list[int]) -> None:
    runs = page_runs(pages)
    assert [first + i for first, n in runs for i in range(n)] == pages
    assert all(n >= 1 for _, n in runs)
