"""The KV and small-op benchmarks at tiny sizes: they run, measure their baselines, and write sane JSON."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from bench.native import native_round_trip_us, parse_pingpong
from rfork.cli import main


def test_parse_pingpong_reads_usec_per_transfer() -> None:
    out = (
        "bytes   #sent   #ack     total       time     MB/sec    usec/xfer   Mxfers/sec\n"
        "64      2k      =2k      250k        0.01s     19.01       3.37       0.30\n"
    )
    assert parse_pingpong(out, 64) == 3.37
    with pytest.raises(ValueError, match="no 128-byte row"):
        parse_pingpong(out, 128)


@pytest.mark.skipif(shutil.which("fi_pingpong") is None, reason="libfabric-bin not installed")
@pytest.mark.parametrize("provider", ["tcp", "shm"])
@pytest.mark.timeout(120)
def test_native_round_trip_is_measured(provider: str) -> None:
    rtt = native_round_trip_us(provider, iterations=200)
    assert 0 < rtt < 1e6


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_bench_kv_tiny(provider: str, tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    argv = ["bench", "kv", "--provider", provider, "--layers", "2", "--kv-heads", "2", "--head-dim", "64"]
    assert main([*argv, "--prompts", "32,100", "--seconds", "0.01", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["prompt_tokens"] for r in doc["rows"]] == [32, 100]
    for r in doc["rows"]:
        assert r["request_bytes"] == 2 * 2 * -(-r["prompt_tokens"] // 16) * 16 * 2 * 64 * 2
        for key in ("requests_per_s", "kv_gb_per_s", "contiguous_gb_per_s", "ratio"):
            assert math.isfinite(r[key])
            assert r[key] > 0


def test_bench_kv_refuses_bad_prompt_list() -> None:
    with pytest.raises(SystemExit):
        main(["bench", "kv", "--prompts", "12,abc"])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_small_ops_measure(provider: str) -> None:
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    import numpy as np

    from backends import MemoryRegionDescriptor, TransferEngine
    from bench import small_ops
    from bench.transport import REGION, start_peer, stop_peer

    peer, conn, src_b, dst_b = start_peer(provider, 1)
    try:
        kw: dict[str, Any] = {"host": "127.0.0.1"} if provider == "tcp" else {}
        with TransferEngine(provider, 1, **kw) as eng:
            reg = eng.register(np.ones(REGION, dtype=np.uint8), "rw")
            res = small_ops.measure(
                eng,
                reg,
                MemoryRegionDescriptor.from_bytes(src_b),
                MemoryRegionDescriptor.from_bytes(dst_b),
                provider,
                seconds=0.01,
            )
        for key in (
            "lane_read_64_p50_us",
            "future_read_64_p50_us",
            "write_1mib_gb_per_s",
            "lane_pages_16k_gb_per_s",
        ):
            assert res[key] > 0
        assert all(math.isfinite(v) for v in res.values())
        assert len(small_ops.report_lines(res)) == 2
    finally:
        stop_peer(peer, conn)
