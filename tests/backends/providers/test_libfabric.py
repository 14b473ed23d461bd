"""The libfabric provider: opening domains keeps the application's Python signal handlers."""

from __future__ import annotations

import os
import subprocess
import sys

SIGNAL_PROBE = r"""
import os, signal, sys
hits = []
signal.signal(signal.SIGTERM, lambda s, f: hits.append(s))
signal.signal(signal.SIGINT, lambda s, f: hits.append(s))
from backends import TransferEngine, provider_available
engines = [TransferEngine("tcp", 1, host="127.0.0.1")]
if provider_available("shm"):
    engines.append(TransferEngine("shm", 1))
for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT):
    os.kill(os.getpid(), sig)
for e in engines:
    e.close()
print("survived", len(hits), len(engines))
"""


def test_opening_engines_keeps_python_signal_handlers() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SIGNAL_PROBE],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "FI_TCP_IFACE": "lo"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    words = proc.stdout.split()
    assert words[:2] == ["survived", "3"], proc.stdout
