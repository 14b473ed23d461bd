"""Stripes, the verifiable unit of a TP slice: the grid, the digests a seed publishes, the anchor that
covers them, and the shard read plan (its reads applied by memcpy here, so that any shape can be tried)."""

from __future__ import annotations

import base64

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends import shard_tensor
from planner.contract import RankManifest, digest_set
from rfork.errors import ChecksumMismatch, DestinationMismatch, PullError
from rfork.identity import CHECKPOINT_LAYOUT
from rfork.pull.read_plan import ReadPlan
from rfork.weights import checksum as ck
from rfork.weights.rank_weights import RankWeights
from rfork.weights.stripes import StripeGrid, grid_for, publishes_stripes, tensors_stripes, whole_identity
from tests.rfork.conftest import identity_of

COLUMN = "model.layers.0.mlp.up_proj.weight"  # split along dim 0
ROW = "model.layers.0.mlp.down_proj.weight"  # split along dim 1
NORM = "model.layers.0.input_layernorm.weight"  # replicated


def _manifest(weights: RankWeights) -> RankManifest:
    weights.striped = True
    return weights.manifest([b""] * len(weights.layout.region_sizes))


def _apply(plan: ReadPlan, src: RankWeights, chunk_bytes: int) -> None:
    """Do the plan's reads as memcpy from the seed's regions (what the engine does over the wire)."""
    src_flat = [b.view(torch.uint8) for b in src.buffers]
    dst_flat = [b.view(torch.uint8) for b in plan.dest.buffers]
    for reads in plan.reads(chunk_bytes):
        last = -1
        for rd in reads:
            assert rd.offset >= last, "reads go in address order"
            last = rd.offset + rd.nbytes
            assert rd.nbytes <= chunk_bytes
            dst_flat[rd.region][rd.offset : rd.offset + rd.nbytes] = src_flat[rd.src_region][
                rd.src_offset : rd.src_offset + rd.nbytes
            ]


def _verify(plan: ReadPlan) -> None:
    """What the one-sided reader checks: each span's bytes, then the strided stripes."""
    plan.accept_empty()
    for span in plan.spans:
        region = plan.dest.buffers[span.region].view(torch.uint8)
        plan.accept(span.names, ck.tensor_checksum(region[span.offset : span.end]))
    plan.accept_strided()


def test_the_grid_follows_the_sharding_rule() -> None:
    assert grid_for(COLUMN, (704, 256)) == StripeGrid(0, 8)
    assert grid_for(ROW, (256, 704)) == StripeGrid(1, 8)
    assert grid_for(NORM, (256,)) is None
    assert grid_for(COLUMN, (6, 4)) == StripeGrid(0, 2)  # gcd(6, 8)
    assert grid_for(COLUMN, (7, 4)) is None  # no even split at all
    grid = StripeGrid(1, 8)
    assert [grid.for_rank(2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert grid.for_rank(3, 0) is None


def test_stripe_digests_are_the_digests_of_the_gathered_slices() -> None:
    t = torch.arange(4 * 16, dtype=torch.int32).reshape(4, 16)
    stripes = tensors_stripes({ROW: t, NORM: torch.ones(16)}).get(ROW)
    assert stripes is not None
    assert stripes.dim == 1
    assert len(stripes.digests) == 8
    assert stripes.digests[3] == ck.tensor_checksum(t[:, 6:8].contiguous())
    assert len(set(stripes.digests)) == 8
    assert NORM not in tensors_stripes({ROW: t, NORM: torch.ones(16)})


def test_only_whole_checkpoint_tensors_publish_stripes(small_ckpt) -> None:
    one, two = identity_of(small_ckpt), identity_of(small_ckpt, tp=2)
    assert publishes_stripes(one)
    assert not publishes_stripes(two)
    assert not publishes_stripes(one.model_copy(update={"framework": "vllm"}))
    assert whole_identity(two) == one
    assert whole_identity(one) is None
    assert whole_identity(two.model_copy(update={"framework_version": "vllm-0"})) is None
    assert one.framework_version == CHECKPOINT_LAYOUT


def test_the_anchored_digest_set_covers_the_stripes() -> None:
    w = RankWeights.from_state_dict({ROW: torch.randn(8, 16), NORM: torch.ones(16)})
    plain = [t.model_dump() for t in w.manifest([b""]).tensors]
    striped = [t.model_dump() for t in _manifest(w).tensors]
    assert all("stripes" not in t for t in plain)  # serialized as before the field existed
    assert plain[0]["checksum"] == striped[0]["checksum"]
    assert digest_set("blake3", plain) != digest_set("blake3", striped)
    # a tensor without stripes hashes as before the field existed, null or absent
    nulls = [{**t, "stripes": None} for t in plain]
    assert digest_set("blake3", nulls) == digest_set("blake3", plain)
    striped[0]["stripes"]["digests"][2] = "0" * 64
    again = [t.model_dump() for t in _manifest(w).tensors]
    assert digest_set("blake3", striped) != digest_set("blake3", again)


def test_a_manifest_with_stripes_that_do_not_divide_the_tensor_is_refused() -> None:
    w = RankWeights.from_state_dict({ROW: torch.randn(8, 16)})
    raw = _manifest(w).model_dump()
    raw["regions"][0]["descriptor"] = base64.b64encode(b"x").decode()
    raw["tensors"][0]["stripes"]["digests"] = raw["tensors"][0]["stripes"]["digests"][:3]
    manifest = RankManifest.model_validate(raw)
    assert "3 stripes do not divide dim 1 of size 16" in (manifest.conflicts() or "")
    with pytest.raises(ValueError, match="do not divide"):
        manifest.check()
    raw["tensors"][0]["stripes"] = {"dim": 2, "digests": ["a", "b"]}
    assert "along dim 2 of a 2-dim tensor" in (RankManifest.model_validate(raw).conflicts() or "")


@settings(max_examples=40, deadline=None)
@given(
    tensors=st.lists(
        st.tuples(
            st.sampled_from(["col", "row", "norm", "row3d"]),
            st.integers(1, 3),  # rows / leading size
            st.sampled_from([8, 16, 24, 40]),  # the split dim's size
            st.sampled_from([torch.bfloat16, torch.float32, torch.int8]),
        ),
        min_size=1,
        max_size=5,
    ),
    tp=st.sampled_from([1, 2, 4, 8]),
    data=st.data(),
    chunk_bytes=st.sampled_from([16, 64, 1 << 20]),
)
def test_a_shard_plan_reads_exactly_the_slice_and_verifies_it(tensors, tp, data, chunk_bytes) -> None:
    state: dict[str, torch.Tensor] = {}
    for i, (kind, lead, size, dtype) in enumerate(tensors):
        shape = {"col": (size, lead), "row": (lead, size), "norm": (size,), "row3d": (lead, size, 2)}[kind]
        suffix = {"col": COLUMN, "row": ROW, "norm": NORM, "row3d": ROW}[kind]
        name = f"t{i}.{suffix}"
        state[name] = torch.randint(-100, 100, shape, dtype=torch.int32).to(dtype)
    src = RankWeights.from_state_dict(state)
    manifest = _manifest(src)
    rank = data.draw(st.integers(0, tp - 1))
    dest = RankWeights.allocate_shard(manifest, tp=tp, rank=rank)
    for b in dest.buffers:
        b.fill_(0x5A)
    plan = ReadPlan.check_shard(manifest, dest, tp=tp, rank=rank)

    _apply(plan, src, chunk_bytes)
    _verify(plan)

    for name, full in state.items():
        assert torch.equal(dest.tensors[name], shard_tensor(name, full, tp, rank)), name
    assert plan.nbytes == dest.layout.total_bytes  # nothing read twice, nothing outside the slice
    assert set(dest.checksums) <= set(state)  # stripes are not tensors


def test_a_flipped_byte_in_a_strided_stripe_is_caught() -> None:
    src = RankWeights.from_state_dict({ROW: torch.randn(4, 16)})
    manifest = _manifest(src)
    dest = RankWeights.allocate_shard(manifest, tp=2, rank=1)
    plan = ReadPlan.check_shard(manifest, dest, tp=2, rank=1)
    _apply(plan, src, 1 << 20)
    dest.tensors[ROW][2, 5] += 1  # stripe 6 of 8 (columns 12-13 of 16): rank 1's third
    with pytest.raises(ChecksumMismatch, match="#stripe6"):
        _verify(plan)


def test_a_shard_plan_is_refused_before_any_read() -> None:
    src = RankWeights.from_state_dict({ROW: torch.randn(4, 16), NORM: torch.ones(16)})
    plain = src.manifest([b""])  # no stripes: the slice could not be verified
    dest = RankWeights.allocate_shard(plain, tp=2, rank=0)
    with pytest.raises(PullError, match="publishes no stripes"):
        ReadPlan.check_shard(plain, dest, tp=2, rank=0)
    striped = _manifest(src)
    with pytest.raises(PullError, match="publishes no stripes"):  # 8 stripes: 3 does not divide them
        ReadPlan.check_shard(striped, RankWeights.allocate_shard(striped, tp=3, rank=0), tp=3, rank=0)
    wrong = RankWeights.from_state_dict({ROW: torch.randn(4, 16), NORM: torch.ones(16)})  # whole, not a slice
    with pytest.raises(DestinationMismatch, match="rank 0 of TP=2's slice"):
        ReadPlan.check_shard(striped, wrong, tp=2, rank=0)


def test_an_empty_slice_reads_nothing_and_a_slice_that_is_the_whole_tensor_reads_it_whole() -> None:
    bias = "model.layers.0.self_attn.k_proj.bias"  # size 1 along its split dim: rank 1 of TP=2 holds none
    src = RankWeights.from_state_dict({bias: torch.ones(1), ROW: torch.randn(4, 16)})
    manifest = _manifest(src)
    empty = RankWeights.allocate_shard(manifest, tp=2, rank=1)
    plan = ReadPlan.check_shard(manifest, empty, tp=2, rank=1)
    _apply(plan, src, 1 << 20)
    _verify(plan)  # an honest seed is not blamed for the empty slice
    assert plan.nbytes == empty.layout.total_bytes
    whole = RankWeights.allocate_shard(manifest, tp=2, rank=0)  # rank 0's slice of the bias: all of it
    plan = ReadPlan.check_shard(manifest, whole, tp=2, rank=0)
    _apply(plan, src, 1 << 20)
    _verify(plan)  # against the tensor's own digest
    assert torch.equal(whole.tensors[bias], torch.ones(1))


def test_a_slice_is_not_read_into_tensors_that_share_bytes() -> None:
    src = RankWeights.from_state_dict({COLUMN: torch.randn(16, 4), ROW: torch.randn(4, 16)})
    manifest = _manifest(src)
    buffer = torch.empty(64, dtype=torch.float32)
    overlapping = {COLUMN: buffer[:32].view(8, 4), ROW: buffer[24:56].view(4, 8)}  # 8 floats in common
    with pytest.raises(PullError, match="share bytes"):
        ReadPlan.check_shard(manifest, RankWeights.from_tensors(tensors=overlapping), tp=2, rank=0)
