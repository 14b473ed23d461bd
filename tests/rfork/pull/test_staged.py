"""rfork.pull.staged on host tensors: a failed tensor stops the reads not yet started (nothing lands in
the destination after the pull returns), and a whole staged pull lands and verifies.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rfork.errors import ChecksumMismatch
from rfork.pull.read_plan import ReadPlan
from rfork.pull.staged import pull_staged
from rfork.weights.rank_weights import RankWeights
from tests.waiting import holds_for

os.environ.setdefault("FI_TCP_IFACE", "lo")

N_TENSORS = 24


@pytest.fixture
def engines() -> Iterator[tuple[Any, Any]]:
    from backends import TransferEngine, provider_available

    if not provider_available("tcp", "127.0.0.1"):
        pytest.skip("libfabric tcp provider is not available")
    with TransferEngine("tcp", 1, timeout_s=5.0, host="127.0.0.1") as seed, \
            TransferEngine("tcp", 1, timeout_s=5.0, host="127.0.0.1") as loader:
        yield seed, loader


def _served(seed_engine: Any) -> tuple[dict[str, torch.Tensor], Any]:
    g = torch.Generator().manual_seed(5)
    tensors = {f"t{i:02d}": torch.randn(64 << 10, generator=g).to(torch.bfloat16) for i in range(N_TENSORS)}
    served = RankWeights.from_tensors(tensors=tensors)
    regions = [seed_engine.register(t, "read") for t in served.registrables()]
    manifest = served.manifest([r.descriptor.to_bytes() for r in regions])
    return tensors, manifest


def _gated_reads(engine: Any, monkeypatch: pytest.MonkeyPatch, gate: threading.Event) -> list[int]:
    """Count the reads that start; every read after the first waits for `gate` (a slow wire, without a
    clock: the test cannot race the machine's load)."""
    reads: list[int] = []
    lock = threading.Lock()
    real = engine.read

    def slow_read(*args: Any, **kw: Any) -> Any:
        with lock:
            reads.append(args[2])
            first = len(reads) == 1
        if not first:
            assert gate.wait(30), "the pull never closed its reader"
        return real(*args, **kw)

    monkeypatch.setattr(engine, "read", slow_read)
    return reads


@pytest.mark.timeout(60)
def test_a_bad_digest_stops_the_reads_not_yet_started(
    engines: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    from backends import StagedReader

    seed, loader = engines
    _tensors, manifest = _served(seed)
    dest = RankWeights.from_tensors(tensors={t.name: torch.zeros(64 << 10, dtype=torch.bfloat16)
                                             for t in manifest.tensors})
    # the tensor read first (spans go in the destination's region order) does not verify
    first = ReadPlan.check(manifest, dest).spans[0].names[0]
    next(t for t in manifest.tensors if t.name == first).checksum = "0" * 32
    manifest.check()
    # the wire stays shut until the failed pull closes its reader, which waits out the read it runs
    closing = threading.Event()
    close = StagedReader.close

    def open_wire_then_close(self: Any) -> None:
        closing.set()
        close(self)

    monkeypatch.setattr(StagedReader, "close", open_wire_then_close)
    reads = _gated_reads(loader, monkeypatch, closing)
    with pytest.raises(ChecksumMismatch, match=first):
        pull_staged(loader, ReadPlan.check(manifest, dest), deadline=time.monotonic() + 30, progress=None,
                    phases={})
    n = len(reads)
    # nothing is read after the pull returned (a read still queued would start within the window)
    holds_for(lambda: len(reads) == n, 0.3, "no read after the pull returned")
    # the first tensor's read, and at most the one running when the pull failed; the rest were cancelled
    assert n <= 2, f"{n} of {N_TENSORS} tensors were still read after the first failed"
    untouched = sum(int(dest.tensors[f"t{i:02d}"].count_nonzero()) == 0 for i in range(N_TENSORS))
    assert untouched >= N_TENSORS - 2


@pytest.mark.timeout(60)
def test_a_staged_pull_lands_and_verifies(engines: tuple) -> None:
    seed, loader = engines
    tensors, manifest = _served(seed)
    manifest.check()
    dest = RankWeights.from_tensors(tensors={n: torch.zeros_like(t) for n, t in tensors.items()})
    phases: dict[str, float] = {}
    done: list[tuple[int, int]] = []
    pull_staged(loader, ReadPlan.check(manifest, dest), deadline=time.monotonic() + 30,
                progress=lambda d, t: done.append((d, t)), phases=phases)
    assert all(torch.equal(dest.tensors[n], t) for n, t in tensors.items())
    assert set(dest.checksums) == set(tensors)
    assert done[-1][0] == done[-1][1] == sum(t.numel() * 2 for t in tensors.values())
    assert set(phases) == {"transfer", "verify"}


def _overlapping(buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Two views of one buffer that share half their bytes (a fused parameter and a slice of it, say)."""
    return {"a": buf[0:1024], "b": buf[512:1536]}


@pytest.mark.timeout(60)
def test_a_later_overlapping_read_cannot_change_a_verified_tensor(engines: tuple) -> None:
    """The seed lays `a` and `b` out apart (each verifies on its own); the loader's views overlap, so
    reading `b` rewrites half of `a`. Each span is verified once, after the last read that overlaps it."""
    seed, loader = engines
    g = torch.Generator().manual_seed(9)
    apart = {n: torch.randn(1024, generator=g).to(torch.bfloat16) for n in ("a", "b")}
    served = RankWeights.from_tensors(tensors=apart)
    regions = [seed.register(t, "read") for t in served.registrables()]
    manifest = served.manifest([r.descriptor.to_bytes() for r in regions])
    manifest.check()
    dest = RankWeights.from_tensors(tensors=_overlapping(torch.zeros(1536, dtype=torch.bfloat16)))
    with pytest.raises(ChecksumMismatch, match="'a'"):
        pull_staged(loader, ReadPlan.check(manifest, dest), deadline=time.monotonic() + 30, progress=None,
                phases={})
    assert "a" not in dest.checksums


@pytest.mark.timeout(60)
def test_overlapping_views_that_agree_with_the_seed_verify(engines: tuple) -> None:
    seed, loader = engines
    g = torch.Generator().manual_seed(10)
    source = torch.randn(1536, generator=g).to(torch.bfloat16)
    served = RankWeights.from_tensors(tensors=_overlapping(source))
    regions = [seed.register(t, "read") for t in served.registrables()]
    manifest = served.manifest([r.descriptor.to_bytes() for r in regions])
    manifest.check()
    buf = torch.zeros(1536, dtype=torch.bfloat16)
    dest = RankWeights.from_tensors(tensors=_overlapping(buf))
    pull_staged(loader, ReadPlan.check(manifest, dest), deadline=time.monotonic() + 30, progress=None,
                phases={})
    assert set(dest.checksums) == {"a", "b"}
    assert torch.equal(buf, source)


def test_final_reads_groups_overlapping_spans():
    from rfork.pull.staged import _final_reads

    # region 0: [0,10) and [5,15) overlap, [15,20) only touches; region 1: [0,10) alone
    spans = [(0, 5, 10), (0, 15, 5), (1, 0, 10), (0, 0, 10)]
    assert _final_reads(spans) == {3: [0, 3], 1: [1], 2: [2]}
