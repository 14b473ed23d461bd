"""A cryptographic digest for operators who need one (issue #21, deliverable 2): RFORK_DIGEST=blake3
makes host tensors (seeds, loaders, the streamed verification) use BLAKE3 instead of xxh3-128."""

from __future__ import annotations

import blake3
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rfork.weights import checksum as ck


@pytest.fixture
def use_blake3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RFORK_DIGEST", "blake3")


def test_blake3_is_the_host_digest_when_chosen(use_blake3):
    t = torch.arange(4096, dtype=torch.int64)
    assert ck.algorithm_for("cpu") == ck.BLAKE3
    assert ck.tensor_checksum(t) == blake3.blake3(t.numpy().tobytes()).hexdigest()
    assert ck.algorithm_for("cuda:0") == ck.DEVICE_DIGEST  # the device keeps its own


def test_an_unknown_digest_is_refused(monkeypatch):
    monkeypatch.setenv("RFORK_DIGEST", "md5")
    with pytest.raises(ValueError, match="RFORK_DIGEST"):
        ck.algorithm_for("cpu")


@given(st.binary(min_size=0, max_size=5000), st.lists(st.integers(1, 700), max_size=20))
@settings(max_examples=50, deadline=None)
def test_streaming_blake3_equals_one_shot_for_any_chunking(data, cuts):
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    d = ck.StreamingDigest(ck.BLAKE3)
    pos = 0
    for c in cuts:
        n = min(c, len(data) - pos)
        d.update(t.data_ptr() + pos, n)
        pos += n
    d.update(t.data_ptr() + pos, len(data) - pos)
    assert d.hexdigest() == blake3.blake3(data).hexdigest()
