"""The device digest (issue #21, finding 3): `pwsum64-v1` was linear, so a quarter of a bf16 tensor
zeroed plus two compensating words kept its digest. Its replacement mixes every word non-linearly
with tensor ops that run on CPU as well, so it is tested here."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rfork.weights import checksum as ck

MASK = (1 << 64) - 1


def _compensated(t: torch.Tensor) -> torch.Tensor:
    """A quarter of `t` zeroed, then two words changed so that any sum of w_i and of w_i*(i+1) mod 2**64
    (the old digest) stays the same: 2,048 + 16 bytes differ."""
    words = t.clone().view(torch.int64)
    before = [int(w) & MASK for w in words]
    words[: words.numel() // 4] = 0
    after = [int(w) & MASK for w in words]
    d_sum = sum(after) - sum(before)
    d_pos = sum((i + 1) * w for i, w in enumerate(after)) - sum((i + 1) * w for i, w in enumerate(before))
    p, q = words.numel() - 2, words.numel() - 1  # q - p = 1 is odd: invertible mod 2**64
    # x + y = -d_sum, (p+1) x + (q+1) y = -d_pos  =>  y = (-d_pos + (p+1) d_sum) / (q - p)
    y = (-d_pos + (p + 1) * d_sum) & MASK
    x = (-d_sum - y) & MASK
    for i, delta in ((p, x), (q, y)):
        v = ((int(words[i]) & MASK) + delta) & MASK
        words[i] = v - (1 << 64) if v >= 1 << 63 else v
    return words.view(torch.uint8)


def test_a_compensated_quarter_no_longer_keeps_the_digest():
    torch.manual_seed(0)
    t = torch.randn(4096, dtype=torch.bfloat16).view(torch.uint8)
    forged = _compensated(t)
    assert int((forged != t).sum()) > 2000
    assert ck.checksum_bytes(forged) != ck.checksum_bytes(t)
    assert ck.algorithm_for("cuda:0") == ck.DEVICE_DIGEST != "pwsum64-v1"  # a new name: anchored anew


@given(st.binary(min_size=0, max_size=3000))
@settings(max_examples=60, deadline=None)
def test_the_device_digest_matches_its_reference(raw):
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    assert ck.checksum_bytes(t) == ck.reference_checksum(raw)


def test_the_device_digest_is_the_same_in_chunks_and_unaligned():
    t = torch.randn(ck.CHUNK_WORDS * 3 + 77, dtype=torch.float32).view(torch.uint8)
    buf = torch.zeros(t.numel() + 8, dtype=torch.uint8)
    buf[3 : 3 + t.numel()] = t
    assert ck.checksum_bytes(buf[3 : 3 + t.numel()]) == ck.checksum_bytes(t)
    small = t[:4099]
    assert ck.checksum_bytes(small) == ck.reference_checksum(bytes(small.numpy().tobytes()))


def test_swapped_and_flipped_words_change_it():
    t = torch.randn(1 << 12, dtype=torch.float32)
    base = ck.checksum_bytes(t.view(torch.uint8))
    w = t.clone().view(torch.int64)
    w[[10, 20]] = w[[20, 10]]
    assert ck.checksum_bytes(w.view(torch.uint8)) != base
    u = t.clone().view(torch.uint8)
    u[12345] ^= 1
    assert ck.checksum_bytes(u) != base
