"""rfork.weights.checksum: the trusted-fleet host digest (xxh3-128, streamed as bytes land; chosen with
RFORK_DIGEST=xxh3-128 here) and the device digest (pmix64-v1).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rfork.weights import checksum as ck


@pytest.fixture(autouse=True)
def trusted_fleet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RFORK_DIGEST", ck.XXH3_128)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4095, ck.CHUNK_WORDS * 8 + 13, 3 * ck.CHUNK_WORDS * 8 + 5])
def test_checksum_matches_reference(n):
    raw = os.urandom(n)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    assert ck.checksum_bytes(t) == ck.reference_checksum(raw)


def test_checksum_sees_one_flipped_byte_and_swapped_words():
    t = torch.randn(1 << 18, dtype=torch.float32)
    base = ck.tensor_checksum(t)
    u = t.clone().view(torch.uint8)
    u[12345] ^= 1
    assert ck.tensor_checksum(u) != base
    w = t.clone().view(torch.int64)
    w[[10, 20]] = w[[20, 10]]
    assert ck.tensor_checksum(w) != base


def test_checksum_is_dtype_and_view_independent_and_handles_unaligned():
    t = torch.randn(1001, dtype=torch.bfloat16)
    assert (
        ck.tensor_checksum(t) == ck.tensor_checksum(t.view(torch.uint8)) == ck.tensor_checksum(t.view(7, 143))
    )
    buf = torch.zeros(4000, dtype=torch.uint8)
    buf[3 : 3 + 2002] = t.view(torch.uint8)
    assert ck.xxh3_bytes(buf[3 : 3 + 2002]) == ck.tensor_checksum(t)
    assert ck.checksum_bytes(buf[3 : 3 + 2002]) == ck.checksum_bytes(
        t.view(torch.uint8)
    )  # the device digest too


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_checksum_same_on_cuda():
    t = torch.randn(3_000_001, dtype=torch.bfloat16)
    assert ck.tensor_checksum(t.cuda()) == ck.checksum_bytes(t.view(torch.uint8))  # pmix64 on the GPU


@given(st.binary(min_size=0, max_size=5000), st.lists(st.integers(1, 700), max_size=20))
@settings(max_examples=100, deadline=None)
def test_streaming_xxh3_equals_one_shot_for_any_chunking(data, cuts):
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    d = ck.StreamingDigest()
    pos = 0
    for c in cuts:
        n = min(c, len(data) - pos)
        d.update(t.data_ptr() + pos, n)
        pos += n
    d.update(t.data_ptr() + pos, len(data) - pos)
    assert d.hexdigest() == ck.tensor_checksum(t)
    assert len(d.hexdigest()) == 32


@pytest.mark.parametrize("algorithm", ck.HOST_ALGORITHMS)
def test_streaming_digest_refuses_a_negative_length(algorithm):
    # a memoryview made with a negative length is read as a huge buffer by the hashers: a crash
    t = torch.arange(64, dtype=torch.uint8)
    d = ck.StreamingDigest(algorithm)
    d.update(t.data_ptr(), 16)
    with pytest.raises(ValueError, match="-8 bytes"):
        d.update(t.data_ptr() + 16, -8)
    with pytest.raises(ValueError, match="8 bytes at 0x0"):
        d.update(0, 8)
    assert d.fed == 16
    d.update(t.data_ptr() + 16, 48)
    assert d.fed == 64
    whole = ck.StreamingDigest(algorithm)
    whole.update(t.data_ptr(), 64)
    assert d.hexdigest() == whole.hexdigest()


def test_host_digest_is_xxh3_and_not_linear():
    import xxhash

    assert ck.algorithm_for("cpu") == ck.XXH3_128
    assert ck.algorithm_for("cuda:0") == ck.DEVICE_DIGEST
    t = torch.arange(4096, dtype=torch.int64)
    assert ck.tensor_checksum(t) == xxhash.xxh3_128_hexdigest(t.numpy().tobytes())
    # Two changes that cancel in any position-weighted sum (w0 += 2, w1 -= 1, w2 ... ) still differ:
    u = t.clone()
    u[0] += 1
    u[2] += 1
    u[1] -= 2  # sum unchanged and sum of w_i*(i+1) unchanged: (1*1) + (1*3) - (2*2) = 0
    assert int(u.sum()) == int(t.sum())
    assert ck.tensor_checksum(u) != ck.tensor_checksum(t)
    # ... and the device digest (pmix64-v1) too, where the linear pwsum64-v1 could not (issue #21)
    assert ck.checksum_bytes(u.view(torch.uint8)) != ck.checksum_bytes(t.view(torch.uint8))
