"""A seed's announced bucket size is checked before the receiver plans or allocates anything from it."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.nccl import (
    NcclPlanMismatchError,
    NcclTransferError,
    Rendezvous,
    connect_rendezvous,
    recv_tensors,
)
from backends.nccl.stream import (
    MAX_BUCKET_BYTES,
    MAX_BUCKETS,
    MIN_BUCKET_BYTES,
    bucket_bytes_refusal,
    plan_buckets,
    send_tensors,
)

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@settings(max_examples=300, deadline=None)
@given(bucket_bytes=INT64, sizes=st.lists(st.integers(0, 1 << 40), max_size=8))
def test_an_accepted_bucket_size_plans_a_bounded_number_of_buckets(
    bucket_bytes: int, sizes: list[int]
) -> None:
    """Whatever a peer announces, an accepted value plans at most MAX_BUCKETS (+ one per tensor) buckets
    and no bucket above MAX_BUCKET_BYTES; a refused one says why."""
    total = sum(sizes)
    refused = bucket_bytes_refusal(bucket_bytes, total)
    if refused is not None:
        assert "bucket_bytes" in refused
        return
    assert MIN_BUCKET_BYTES <= bucket_bytes <= MAX_BUCKET_BYTES
    if total <= (64 << 20):  # planning 1 TiB at 64 KiB is the bound itself; planning is checked below that
        plan = plan_buckets(sizes, bucket_bytes)
        assert len(plan) <= MAX_BUCKETS + len(sizes)
        assert all(b.nbytes <= bucket_bytes for b in plan)
    else:
        assert -(-total // bucket_bytes) <= MAX_BUCKETS


@pytest.mark.parametrize("announced", [1, MIN_BUCKET_BYTES - 1, MAX_BUCKET_BYTES + 1])
def test_a_seed_announcing_tiny_or_huge_buckets_is_refused_before_any_payload(announced: int) -> None:
    """A hostile seed's header with bucket_bytes=1 (a million buckets per MiB on main) fails the
    receiver with a message naming bucket_bytes, and the seed side fails on the refused ack."""
    src = [torch.arange(1024, dtype=torch.float32), torch.zeros(0)]
    dest = [torch.empty_like(t) for t in src]
    rdv = Rendezvous(host="127.0.0.1", timeout_s=5.0)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            send_tensors(
                connect_rendezvous("127.0.0.1", rdv.port, timeout_s=5.0),
                src,
                session_id="b",
                local_host="127.0.0.1",
                timeout_s=5.0,
                bucket_bytes=announced,
            )
        except NcclTransferError as exc:
            errors.append(exc)

    t = threading.Thread(target=send)
    t.start()
    assert rdv.store is not None
    with pytest.raises(NcclPlanMismatchError, match="bucket_bytes"):
        recv_tensors(rdv.store, dest, session_id="b", local_host="127.0.0.1", timeout_s=5.0)
    t.join(10)
    rdv.close()
    assert len(errors) == 1
    assert not torch.equal(dest[0], src[0])  # nothing moved
