"""`rfork bench kv|moe|rl --device`: the device modes at tiny sizes on the CPU stand-in (the same code
as on a GPU: staging copies, the gloo baseline on the "device" tensors, the d2d bound, goals in the
JSON), and a one-line refusal of --device cuda where torch sees no GPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rfork.cli import main

TINY = {
    "kv": ["--layers", "2", "--kv-heads", "4", "--prompts", "64", "--seconds", "0.01"],
    "moe": ["--ranks", "2", "--tokens", "8", "--hidden", "32", "--topk", "2", "--experts", "4",
            "--iters", "3", "--warmup", "1", "--provider", "shm"],
    "rl": ["--receivers", "2", "--size-gib", "0.002", "--repeat", "1", "--provider", "shm"],
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
@pytest.mark.parametrize("bench", sorted(TINY))
def test_device_cuda_refuses_without_a_gpu(bench: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", bench, "--device", "cuda", *TINY[bench]]) != 0
    captured = capsys.readouterr()
    assert "needs a CUDA GPU" in captured.out + captured.err


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("bench", sorted(TINY))
def test_device_mode_on_the_cpu_stand_in(bench: str, tmp_path: Path) -> None:
    out = tmp_path / f"{bench}.json"
    assert main(["bench", bench, "--device", "cpu", *TINY[bench], "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu"
    assert doc["goals"]
    for goal in doc["goals"]:
        assert math.isfinite(goal["figure"])
        assert goal["met"] in (True, False)
    if bench == "moe":
        assert doc["outputs_equal"] is True
        assert all(r["d2d_p50_us"] > 0 for r in doc["rows"])
    if bench == "rl":
        assert all(r["verified"] and r["d2d_s"] > 0 for r in doc["rows"])
    if bench == "kv":
        assert all(r["ratio"] > 0 for r in doc["rows"])
