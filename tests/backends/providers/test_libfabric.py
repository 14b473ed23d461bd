"""The libfabric provider: signal handlers survive opening domains; shm's per-process hazards."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends import BackendUnavailable, TransferEngine, provider_available
from backends.providers.libfabric import libfabric_version, pairs_within_process, shm_address_pid

SIGNAL_PROBE = r"""
import os, signal, sys
hits = []
signal.signal(signal.SIGTERM, lambda s, f: hits.append(s))
signal.signal(signal.SIGINT, lambda s, f: hits.append(s))
import threading
from backends import TransferEngine, provider_available
engines = []
def open_engines():
    engines.append(TransferEngine("tcp", 1, host="127.0.0.1"))
    if provider_available("shm"):
        engines.append(TransferEngine("shm", 1))
if sys.argv[1] == "thread":  # a helper thread opens them (a seed starting beside the framework)
    t = threading.Thread(target=open_engines)
    t.start()
    t.join()
else:
    open_engines()
for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT):
    os.kill(os.getpid(), sig)
for e in engines:
    e.close()
print("survived", len(hits), len(engines))
"""


@pytest.mark.parametrize("opener", ["main", "thread"])
def test_opening_engines_keeps_python_signal_handlers(opener: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SIGNAL_PROBE, opener],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "FI_TCP_IFACE": "lo"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    words = proc.stdout.split()
    assert words[:2] == ["survived", "3"], proc.stdout


STALE_SEGMENT_PROBE = r"""
import os
stale = f"/dev/shm/{os.getpid()}:0:0"
with open(stale, "wb") as f:  # what a SIGKILLed process with this pid left behind
    f.write(bytes(4096))
from backends import TransferEngine
with TransferEngine("shm", 1) as engine:
    print("opened", engine.address.hex())
"""


@pytest.mark.skipif(not provider_available("shm"), reason="shm provider not available")
def test_shm_opens_over_a_stale_segment_of_a_dead_process_with_the_same_pid() -> None:
    # libfabric 1.17 failed fi_enable with EBUSY here (pid reuse after a SIGKILL)
    probe = [sys.executable, "-c", STALE_SEGMENT_PROBE]
    proc = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("opened"), proc.stdout


@given(st.integers(min_value=1, max_value=2**22), st.lists(st.integers(0, 2**32), min_size=2, max_size=3))
def test_shm_address_pid_reads_the_pid_of_either_version_s_names(pid: int, rest: list[int]) -> None:
    assert shm_address_pid("fi_shm://" + ":".join(map(str, [pid, *rest]))) == pid


@pytest.mark.parametrize("addr", ["", "fi_sockaddr_in://127.0.0.1:3", "fi_shm://", "fi_shm://x:0:0", "fi_shm://-1:0"])
def test_shm_address_pid_is_none_for_other_addresses(addr: str) -> None:
    assert shm_address_pid(addr) is None


def test_same_process_peers_are_refused_on_shm_from_2_5_only() -> None:
    assert pairs_within_process("shm", (1, 17))
    assert not pairs_within_process("shm", (2, 5))
    assert pairs_within_process("tcp", (2, 5))


@pytest.mark.skipif(not provider_available("shm"), reason="shm provider not available")
def test_same_process_shm_peer_is_refused_where_the_provider_would_crash() -> None:
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    with TransferEngine("shm", 1, timeout_s=5.0) as a, TransferEngine("shm", 1, timeout_s=5.0) as b:
        ra, rb = a.register(src), b.register(dst)
        if pairs_within_process("shm"):
            b.read(rb, 0, dst.size, ra.descriptor, 0).result(10)
            assert np.array_equal(src, dst)
        else:
            with pytest.raises(BackendUnavailable, match=r"one process.*separate processes"):
                b.read(rb, 0, dst.size, ra.descriptor, 0).result(10)
            assert libfabric_version() >= (2, 5)


BINDING_PROBE = r"""
import os, sys
import backends
assert "backends.providers._native" not in sys.modules
loading = backends.load_binding_soon()
assert backends.load_binding_soon() is loading  # once per process
child = os.fork()  # at once: the fork waits for the load, so the child can load libraries too
if child == 0:
    from backends import TransferEngine
    with TransferEngine("tcp", 1, host="127.0.0.1"):
        os._exit(0)
assert os.waitpid(child, 0)[1] == 0
loading.join(60)
assert "backends.providers._native" in sys.modules
from backends import TransferEngine
with TransferEngine("tcp", 1, host="127.0.0.1") as engine:
    print("opened", loading.name)
"""


def test_the_binding_loads_on_a_helper_thread_before_the_first_engine_and_a_fork() -> None:
    proc = subprocess.run([sys.executable, "-c", BINDING_PROBE], capture_output=True, text=True, timeout=90,
                          env={**os.environ, "FI_TCP_IFACE": "lo"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["opened", "rfork-load-binding"]
