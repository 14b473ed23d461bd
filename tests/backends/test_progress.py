"""Progress threads and region pinning: no read lands in freed memory. A region whose reads timed out
stays registered and alive until the provider has completed them (or the engine closes)."""

from __future__ import annotations

import gc
import logging
import os
import signal
import weakref

import pytest
import torch

from backends import TransferEngine, TransferTimeout
from backends.providers.libfabric import closes_with_ops_posted
from tests.backends.conftest import start_peer
from tests.backends.processes import stop_process
from tests.waiting import holds_for, wait_until

MiB = 1 << 20


def _freed(alive: weakref.ref) -> bool:
    gc.collect()
    return alive() is None


@pytest.mark.timeout(120)
def test_timed_out_reads_keep_their_region_alive_until_the_provider_completes_them() -> None:
    victim = start_peer("tcp", [("src", 32 * MiB, "read")], domains=1, reorder=False)
    engine = TransferEngine("tcp", 1, timeout_s=1.0, host="127.0.0.1")
    try:
        buf = torch.zeros(32 * MiB, dtype=torch.uint8)
        region = engine.register(buf, "read")
        engine.read(region, 0, MiB, victim.descs["src"], 0).result(30)  # connected
        stop_process(victim.proc.pid or 0)
        try:
            fut = engine.read(region, 0, 32 * MiB, victim.descs["src"], 0)
            with pytest.raises(TransferTimeout):
                fut.result(30)
            assert region.posted > 0, "expected reads still posted at the provider after the timeout"
            assert engine.outstanding() == region.posted  # what a loader's fence looks at
            alive = weakref.ref(buf)
            engine.deregister(region)  # what a loader does after a deadline
            del buf, region
            # the reads stay posted while the seed is stopped: a freed region would show within the window
            holds_for(lambda: not _freed(alive), 0.5, "the destination kept while reads into it are posted")
        finally:
            os.kill(victim.proc.pid or 0, signal.SIGCONT)
        # the stopped seed answers the posted reads; then the memory goes, within a bounded time
        wait_until(lambda: _freed(alive), 30, "the region released after its reads completed")
        assert engine.outstanding() == 0
        # and the engine still works
        other = torch.zeros(MiB, dtype=torch.uint8)
        r2 = engine.register(other, "read")
        engine.read(r2, 0, MiB, victim.descs["src"], 0).result(30)
        engine.deregister(r2)
    finally:
        engine.close()
        victim.stop()


@pytest.mark.timeout(120)
def test_engine_close_releases_regions_with_reads_still_posted(caplog: pytest.LogCaptureFixture) -> None:
    victim = start_peer("tcp", [("src", 8 * MiB, "read")], domains=1, reorder=False)
    engine = TransferEngine("tcp", 1, timeout_s=1.0, host="127.0.0.1")
    try:
        buf = torch.zeros(8 * MiB, dtype=torch.uint8)
        region = engine.register(buf, "read")
        engine.read(region, 0, MiB, victim.descs["src"], 0).result(30)
        stop_process(victim.proc.pid or 0)
        fut = engine.read(region, 0, 8 * MiB, victim.descs["src"], 0)
        with pytest.raises(TransferTimeout):
            fut.result(30)
        alive = weakref.ref(buf)
        engine.deregister(region)
        del buf, region
        gc.collect()
        assert alive() is not None
        posted = engine.outstanding()
        assert posted > 0
        if closes_with_ops_posted("tcp"):
            engine.close()  # endpoints gone: nothing can land any more, so the memory may go
            assert engine.outstanding() == 0
            wait_until(lambda: _freed(alive), 10, "the region released when the engine closed")
        else:
            # tcp on libfabric 1.17 can crash closing such an endpoint: the engine leaves it (and the
            # memory the stalled reads target) open instead, and says so
            with caplog.at_level(logging.WARNING, logger="backends.engine"):
                engine.close()
            assert "still posted to a stalled peer" in caplog.text
            assert engine.outstanding() == posted
            gc.collect()
            assert alive() is not None
    finally:
        os.kill(victim.proc.pid or 0, signal.SIGCONT)
        engine.close()
        victim.stop()
