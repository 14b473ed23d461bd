"""`rfork bench gpu` without a GPU: the one-line refusal, the figures' arithmetic, goals, table and JSON
with made-up timings, the page-cache residency probe, and the staged row run on host memory.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from bench import gpu_report as report

GIB = 1 << 30


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is absent")
def test_gpu_bench_one_line_error_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.gpu import main

    assert main(["--size-gib", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: bench.gpu needs a CUDA GPU (torch.cuda.is_available() is false here)"


def _rows(ipc_s: float = 0.004, shm_s: float = 0.5, digest_s: float = 0.05) -> list[dict]:
    n = 8 * GIB
    return [
        {"source": report.D2D, "kind": "baseline", "seconds": 0.003},
        {"source": report.PINNED_H2D, "kind": "baseline", "seconds": 0.34},
        {"source": report.DISK_COLD, "kind": "disk", "seconds": 9.0, "page_cache": "dropped, 0% resident"},
        {"source": report.DISK_WARM, "kind": "disk", "seconds": 3.0, "page_cache": "warm"},
        {"source": "rfork cuda-ipc (driver)", "kind": "rfork", "seconds": ipc_s, "verified": True},
        {"source": "rfork tcp+staging", "kind": "rfork", "seconds": 2.0, "verified": True},
        {"source": "rfork shm+staging", "kind": "rfork", "seconds": shm_s, "verified": True},
        {"source": report.DEVICE_DIGEST, "kind": "digest", "seconds": digest_s, "bytes": n, "verified": True},
    ]


def test_derived_columns_from_made_up_timings() -> None:
    rows = report.finish(_rows(), 8 * GIB)
    by = {r["source"]: r for r in rows}
    assert by[report.D2D]["gb_per_s"] == pytest.approx(8 * GIB / 0.003 / 1e9)
    assert by["rfork cuda-ipc (driver)"]["x_of_d2d"] == pytest.approx(0.003 / 0.004)
    assert by["rfork shm+staging"]["x_of_pinned_h2d"] == pytest.approx(0.34 / 0.5)
    assert by["rfork tcp+staging"]["speedup_vs_disk_cold"] == pytest.approx(4.5)
    assert by[report.DISK_COLD]["speedup_vs_disk_cold"] == pytest.approx(1.0)


def test_goals_met_and_not_met() -> None:
    judged = {g["goal"].split()[1] if g["goal"].startswith("rfork") else g["goal"]: g
              for g in report.goals(report.finish(_rows(), 8 * GIB))}
    by_prefix = {k[:12]: v for k, v in judged.items()}
    assert by_prefix["cuda-ipc"]["met"] is True  # 0.004 s <= 2 x 0.003 s
    assert by_prefix["shm+staging"]["met"] is False  # 0.68x pinned h2d < 0.7x
    assert by_prefix["every R-Fork"]["met"] is False  # tcp: 4.5x < 10x
    assert by_prefix["device diges"]["met"] is True  # 8 GiB / 0.05 s = 172 GB/s
    slow = report.goals(report.finish(_rows(ipc_s=0.007, shm_s=0.4, digest_s=0.2), 8 * GIB))
    assert [g["met"] for g in slow] == [False, True, False, False]


def test_goals_say_not_measured_and_unverified_is_not_met() -> None:
    rows = [r for r in _rows() if r["source"] != "rfork shm+staging"]
    rows[4]["verified"] = False
    judged = report.goals(report.finish(rows, 8 * GIB))
    assert judged[0]["met"] is False  # fast enough, but not verified
    assert judged[1]["figure"] is None
    assert judged[1]["met"] is None


def test_tables_print_and_json_is_strict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = report.finish(_rows(), 8 * GIB)
    rows.append({"source": "x", "seconds": 0.0, "kind": "rfork"})  # a zero time: no ratios, no NaN
    report.finish(rows, 8 * GIB)
    judged = report.goals(rows)
    report.print_tables(rows, judged, "title")
    out = capsys.readouterr().out
    assert "rfork shm+staging" in out
    assert "NOT met" in out
    path = tmp_path / "gpu.json"
    report.write_json(path, {"gpu": "made up"}, rows, judged, ["a path failed"])
    doc = json.loads(path.read_text())
    assert set(doc) == {"machine", "rows", "goals", "errors"}
    assert doc["rows"][-1]["gb_per_s"] is None


def test_resident_fraction_of_a_fresh_file(tmp_path: Path) -> None:
    from bench.gpu import resident_fraction

    f = tmp_path / "shard.safetensors"
    f.write_bytes(os.urandom(1 << 20))
    frac = resident_fraction([f])
    assert frac is not None
    assert 0.0 <= frac <= 1.0
    assert resident_fraction([tmp_path / "missing"]) is None


@pytest.mark.timeout(60)
def test_staged_row_on_host_memory_verifies_what_landed() -> None:
    """The bench's staged row with host memory standing in for the GPU (same code, no CUDA)."""
    from backends import TransferEngine, provider_available
    from bench.gpu_peers import staged_row
    from rfork.weights import checksum as ck

    if not provider_available("tcp", "127.0.0.1"):
        pytest.skip("libfabric tcp provider is not available")
    src = torch.randn(4 << 20, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    args = argparse.Namespace(bounce_mib=1, depth=3, domains=2)
    with TransferEngine("tcp", 1, host="127.0.0.1", timeout_s=10.0) as seed:
        desc = seed.register(src, "read").descriptor.to_bytes()
        dst = torch.zeros_like(src)
        row = staged_row("tcp", desc, dst, ck.tensor_checksum(src), args)
    assert row["verified"] is True
    assert row["source"] == "rfork tcp+staging"
    assert torch.equal(dst, src)


def test_checkpoint_writer_and_disk_rows_on_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk rows' code on the CPU: shards of the synthetic Llama's bf16 tensors, loaded back."""
    import bench.gpu as bg

    monkeypatch.setattr(bg, "drop_page_cache", lambda files: "dropped (test)")  # never the host's cache
    specs = bg.checkpoint_specs(8 << 20)
    files = bg.write_checkpoint(tmp_path / "ckpt", specs, torch.device("cpu"), shard_bytes=2 << 20)
    assert len(files) > 1
    rows = bg.disk_rows(files, torch.device("cpu"), bg.specs_bytes(specs))
    assert [r["source"] for r in rows] == [report.DISK_COLD, report.DISK_WARM]
    assert rows[0]["page_cache"].startswith("dropped (test)")
    assert all(r["seconds"] > 0 for r in rows)
    from safetensors.torch import load_file

    loaded = {k: v for f in files for k, v in load_file(str(f)).items()}
    assert {n: tuple(s) for n, _d, s in specs} == {n: tuple(t.shape) for n, t in loaded.items()}
    assert all(t.dtype == torch.bfloat16 for t in loaded.values())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_whole_bench_rehearsed_on_cpu(tmp_path: Path) -> None:
    """Two processes, the staged paths over tcp and shm, the digest row, goals and JSON: the bench's
    code end to end with host memory (no CUDA IPC, no disk rows: those drop the host's page cache)."""
    from backends import provider_available
    from bench.gpu import main

    if not provider_available("tcp", "127.0.0.1"):
        pytest.skip("libfabric tcp provider is not available")
    out = tmp_path / "gpu.json"
    rc = main(["--rehearse-on-cpu", "--size-gib", "0.05", "--skip", "disk", "--bounce-mib", "1",
               "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["errors"] == []
    assert rc == 0
    sources = [r["source"] for r in doc["rows"]]
    assert sources[:2] == [report.D2D, report.PINNED_H2D]
    assert "rfork tcp+staging" in sources
    assert all(r["verified"] for r in doc["rows"] if r["kind"] in ("rfork", "digest"))
    assert doc["machine"]["gpu"].startswith("none")
