"""Native libfabric baselines for the benchmarks: `fi_pingpong` (libfabric-bin) on the same provider.

fi_pingpong reports microseconds per transfer, one direction; a one-sided read is a full round trip,
so the baseline for a read's latency is twice that figure.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time

from bench.processes import free_port

log = logging.getLogger(__name__)

LIBFABRIC_PROVIDERS = {"tcp": "tcp;ofi_rxm", "shm": "shm"}


def parse_pingpong(output: str, size: int) -> float:
    """usec/xfer from fi_pingpong's table row for `size`; ValueError when the row is missing."""
    for line in output.splitlines():
        cols = line.split()
        if len(cols) >= 7 and cols[0] == str(size):
            return float(cols[6])
    raise ValueError(f"no {size}-byte row in fi_pingpong output: {output.strip()[-200:]!r}")


def native_round_trip_us(
    provider: str, size: int = 64, iterations: int = 2000, timeout_s: float = 60.0
) -> float:
    """Round-trip microseconds of `size`-byte messages between two fi_pingpong processes.

    Raises RuntimeError (with the tool's output) when fi_pingpong is missing or fails.
    """
    exe = shutil.which("fi_pingpong")
    if exe is None:
        raise RuntimeError("fi_pingpong not found: install libfabric-bin (scripts/dev.sh setup does)")
    env = {**os.environ, "FI_TCP_IFACE": os.environ.get("FI_TCP_IFACE", "lo")}
    common = ["-p", LIBFABRIC_PROVIDERS[provider], "-e", "rdm", "-S", str(size), "-I", str(iterations)]
    last = ""
    for _attempt in range(3):  # the control port is picked free, then bound by the server: retry a race
        port = str(free_port())
        server = subprocess.Popen(
            [exe, *common, "-B", port], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            time.sleep(0.3)
            client = subprocess.run(
                [exe, *common, "-P", port, "127.0.0.1"],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
            last = client.stdout + client.stderr
            if client.returncode == 0:
                return 2 * parse_pingpong(client.stdout, size)
        except subprocess.TimeoutExpired:
            last = "fi_pingpong client timed out"
        finally:
            server.kill()
            server.wait(5)
    raise RuntimeError(f"fi_pingpong on {provider} failed: {last.strip()[-300:]}")
