"""`rfork bench gpu` where CUDA is absent: one line of error, not a traceback (the runs need a GPU)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is absent")
def test_gpu_bench_one_line_error_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.gpu import main

    assert main(["--size-gib", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: bench.gpu needs a CUDA GPU (torch.cuda.is_available() is false here)"
