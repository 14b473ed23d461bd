"""BLAKE3 computed with torch ops on the tensor's device equals the `blake3` package bit for bit, so a
digest anchored from disk and one checked where GPU bytes land agree (the same code runs on CPU here)."""

from __future__ import annotations

import blake3
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rfork.weights.blake3_tensor import CHUNK_LEN, blake3_hex


def _tensor(raw: bytes, device: str = "cpu") -> torch.Tensor:
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return t.to(device)


def _pattern(n: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return bytes(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes())


EDGE_SIZES = [
    0,
    1,
    63,
    64,
    65,
    1023,
    1024,
    1025,
    2048,
    3 * 1024,
    3 * 1024 + 1,
    5 * 1024 - 1,
    6 * 1024,
    7 * 1024 + 500,
    9 * 1024,
    31 * 1024 + 64,
]


@pytest.mark.parametrize("n", EDGE_SIZES)
def test_edge_sizes_match_the_package(n):
    raw = _pattern(n, n)
    assert blake3_hex(_tensor(raw)) == blake3.blake3(raw).hexdigest()


@given(
    chunks=st.integers(0, 40),
    extra=st.one_of(st.just(0), st.integers(1, CHUNK_LEN - 1)),
    seed=st.integers(0, 2**16),
    per_pass=st.sampled_from([None, 1, 2, 3, 7]),
)
@example(chunks=0, extra=0, seed=0, per_pass=None)
@example(chunks=13, extra=0, seed=1, per_pass=4)  # 13 chunks: odd nodes at three tree levels
@settings(max_examples=60, deadline=None)
def test_any_size_and_pass_split_matches_the_package(chunks, extra, seed, per_pass):
    raw = _pattern(chunks * CHUNK_LEN + extra, seed)
    assert blake3_hex(_tensor(raw), chunks_per_pass=per_pass) == blake3.blake3(raw).hexdigest()


@given(st.binary(min_size=0, max_size=4 * CHUNK_LEN + 300))
@settings(max_examples=40, deadline=None)
def test_arbitrary_bytes_match_the_package(raw):
    assert blake3_hex(_tensor(raw)) == blake3.blake3(raw).hexdigest()


def test_an_unaligned_view_and_high_bytes():
    raw = b"\xff" * (2 * CHUNK_LEN + 77)
    buf = torch.zeros(len(raw) + 3, dtype=torch.uint8)
    buf[3:] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    assert blake3_hex(buf[3:]) == blake3.blake3(raw).hexdigest()


def test_a_flat_uint8_tensor_is_required():
    with pytest.raises(ValueError, match="flat uint8"):
        blake3_hex(torch.zeros(4, dtype=torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [0, 1, 1025, 64 * CHUNK_LEN, (1 << 20) * 3 + 12345, (1 << 26) + 1000])
def test_cuda_matches_the_package(n):
    raw = _pattern(n, 7)
    t = _tensor(raw, "cuda")
    assert blake3_hex(t) == blake3.blake3(raw).hexdigest()
    assert blake3_hex(t[1:], kernel="torch") == blake3.blake3(raw[1:]).hexdigest()  # unaligned
    if n < 1 << 22:  # small passes: many launches each
        assert blake3_hex(t, chunks_per_pass=1000) == blake3.blake3(raw).hexdigest()


INTERPRETED = """
import blake3, torch
from rfork.weights.blake3_tensor import blake3_hex
for n in (0, 1, 1024, 1025, 3 * 1024, 5 * 1024 + 63, 13 * 1024):
    g = torch.Generator().manual_seed(n)
    t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    assert blake3_hex(t, kernel="triton") == blake3.blake3(t.numpy().tobytes()).hexdigest(), n
print("triton kernel ok")
"""


@pytest.mark.slow
def test_the_triton_kernel_in_the_interpreter_matches_the_package():
    """The optional Triton kernel, run by Triton's interpreter on CPU tensors (the GPU test compiles it)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "triton kernel ok" in out.stdout


def test_an_unknown_kernel_setting_is_refused(monkeypatch):
    from rfork.weights.blake3_tensor import kernel_setting

    monkeypatch.setenv("RFORK_BLAKE3_KERNEL", "cuda")
    with pytest.raises(ValueError, match="RFORK_BLAKE3_KERNEL"):
        kernel_setting()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [0, 1, 1024, 1025, 64 * CHUNK_LEN + 5, (1 << 20) * 3 + 12345, (1 << 26) + 1000])
def test_cuda_triton_kernel_matches_the_package(n):
    pytest.importorskip("triton")
    raw = _pattern(n, 8)
    t = _tensor(raw, "cuda")
    assert blake3_hex(t, kernel="triton") == blake3.blake3(raw).hexdigest()
    assert blake3_hex(t[3:], kernel="triton") == blake3.blake3(raw[3:]).hexdigest()  # unaligned
