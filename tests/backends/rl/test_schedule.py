"""The static RL write schedule, executed in memory: every destination byte exactly once, right bytes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.layout import Layout, dtype_from_name
from backends.rl import (
    RankShard,
    RLError,
    Run,
    TensorSpec,
    build_receiver_schedule,
    model_specs,
    shard_layout,
)
from backends.sharding import shard_range

DTYPES = ("uint8", "int16", "float32")


@st.composite
def tensor_specs(draw: st.DrawFn) -> tuple[TensorSpec, ...]:
    out = []
    for i in range(draw(st.integers(1, 5))):
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
        split = draw(st.one_of(st.none(), st.integers(0, len(shape) - 1))) if shape else None
        out.append(TensorSpec(f"t{i}", draw(st.sampled_from(DTYPES)), shape, split))
    return tuple(out)


def full_bytes(spec: TensorSpec, seed: int) -> np.ndarray:
    """The logical tensor as uint8 with a trailing element-byte axis."""
    elem = dtype_from_name(spec.dtype).itemsize
    return np.random.default_rng(seed).integers(0, 256, (*spec.shape, elem), dtype=np.uint8)


def shard_bytes(spec: TensorSpec, full: np.ndarray, tp: int, rank: int) -> bytes:
    if spec.split_dim is None or tp == 1:
        return full.tobytes()
    lo, hi = shard_range(spec.shape[spec.split_dim], tp, rank)
    idx = [slice(None)] * full.ndim
    idx[spec.split_dim] = slice(lo, hi)
    return np.ascontiguousarray(full[tuple(idx)]).tobytes()


def regions_for(specs: tuple[TensorSpec, ...], layout: Layout, tp: int, rank: int) -> list[bytearray]:
    bufs = [bytearray(n) for n in layout.region_sizes]
    for i, (spec, p) in enumerate(zip(specs, layout.placements, strict=True)):
        data = shard_bytes(spec, full_bytes(spec, i), tp, rank)
        assert len(data) == p.nbytes
        if p.nbytes:
            bufs[p.region][p.offset : p.offset + p.nbytes] = data
    return bufs


def execute(runs: tuple[Run, ...], trainers: list[list[bytearray]], dst: list[bytearray]) -> list[np.ndarray]:
    """Apply the runs like the engine would; returns how often each destination byte was written."""
    hits = [np.zeros(len(b), dtype=np.int32) for b in dst]
    for run in runs:
        src = trainers[run.trainer][run.src_region]
        for k in range(run.count):
            so, do = run.src_offset + k * run.src_stride, run.dst_offset + k * run.dst_stride
            assert so >= 0, "source range out of bounds"
            assert so + run.length <= len(src), "source range out of bounds"
            assert do >= 0, "destination out of bounds"
            assert do + run.length <= len(dst[run.dst_region]), "destination out of bounds"
            dst[run.dst_region][do : do + run.length] = src[so : so + run.length]
            hits[run.dst_region][do : do + run.length] += 1
    return hits


@settings(max_examples=150, deadline=None)
@given(
    specs=tensor_specs(),
    trainer_groups=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    receiver_tp=st.integers(1, 4),
    data=st.data(),
    split_min=st.integers(1, 200),
    region_cap=st.integers(16, 400),
)
def test_schedule_writes_every_destination_byte_once_with_the_right_bytes(
    specs: tuple[TensorSpec, ...],
    trainer_groups: list[int],
    receiver_tp: int,
    data: st.DataObject,
    split_min: int,
    region_cap: int,
) -> None:
    # Trainers: one or more replicas, each a TP group of its own size (covers TP=2->1 and 1->2).
    positions = [(tp, r) for tp in trainer_groups for r in range(tp)]
    shards = [
        RankShard(tp, r, shard_layout(specs, tp_size=tp, tp_rank=r, max_region_bytes=region_cap))
        for tp, r in positions
    ]
    receiver_rank = data.draw(st.integers(0, receiver_tp - 1))
    receiver_index = data.draw(st.integers(0, 5))
    dst_layout = shard_layout(specs, tp_size=receiver_tp, tp_rank=receiver_rank, max_region_bytes=region_cap)
    schedule = build_receiver_schedule(
        specs,
        shards,
        RankShard(receiver_tp, receiver_rank, dst_layout),
        receiver_index=receiver_index,
        split_min_bytes=split_min,
    )
    src = [regions_for(specs, s.layout, s.tp_size, s.tp_rank) for s in shards]
    dst = [bytearray(n) for n in dst_layout.region_sizes]
    hits = execute(schedule.runs, src, dst)
    expected = regions_for(specs, dst_layout, receiver_tp, receiver_rank)
    covered = [np.zeros(len(b), dtype=bool) for b in dst]
    for p in dst_layout.placements:
        if p.nbytes:
            got = bytes(dst[p.region][p.offset : p.offset + p.nbytes])
            assert got == bytes(expected[p.region][p.offset : p.offset + p.nbytes]), p.name
            assert (hits[p.region][p.offset : p.offset + p.nbytes] == 1).all(), p.name
            covered[p.region][p.offset : p.offset + p.nbytes] = True
    for h, c in zip(hits, covered, strict=True):
        assert (h[~c] <= 1).all(), "padding written more than once"
    assert set(schedule.contributors) == {r.trainer for r in schedule.runs}
    # Deterministic: the receiver and every trainer compute the same schedule independently.
    again = build_receiver_schedule(
        specs,
        shards,
        RankShard(receiver_tp, receiver_rank, dst_layout),
        receiver_index=receiver_index,
        split_min_bytes=split_min,
    )
    assert again == schedule


def llama_specs() -> tuple[TensorSpec, ...]:
    from tests.backends.rl.peers import CONFIG

    return model_specs(CONFIG.tensor_specs("bfloat16"))


def test_tp2_to_tp1_uses_both_trainers_and_row_parallel_tensors_become_strided_runs() -> None:
    specs = llama_specs()
    trainers = [RankShard(2, r, shard_layout(specs, tp_size=2, tp_rank=r)) for r in (0, 1)]
    tp1 = RankShard(1, 0, shard_layout(specs, tp_size=1, tp_rank=0))
    sched = build_receiver_schedule(specs, trainers, tp1)
    per = sched.bytes_by_trainer()
    assert sched.contributors == (0, 1)
    assert abs(per[0] - per[1]) <= 0.01 * (per[0] + per[1])
    strided = [r for r in sched.runs if r.count > 1]
    # o_proj and down_proj of both layers, one run per trainer each: rows of half the width.
    assert len(strided) == 2 * 2 * 2
    assert all(r.dst_stride == 2 * r.length for r in strided)


def test_same_layout_replicas_split_the_bytes_and_merge_into_few_writes() -> None:
    specs = llama_specs()
    one = shard_layout(specs, tp_size=1, tp_rank=0)
    trainers = [RankShard(1, 0, one), RankShard(1, 0, one)]
    sched = build_receiver_schedule(specs, trainers, RankShard(1, 0, one))
    per = sched.bytes_by_trainer()
    assert abs(per[0] - per[1]) <= 0.05 * (per[0] + per[1])
    assert len(sched.runs) <= 3  # one stripe per trainer, merged across tensors (plus a split)


def test_missing_shard_is_an_error_naming_the_tensor() -> None:
    specs = llama_specs()
    only_rank0 = [RankShard(2, 0, shard_layout(specs, tp_size=2, tp_rank=0))]
    with pytest.raises(RLError, match=r"no trainer holds 'model.embed_tokens.weight' rows"):
        build_receiver_schedule(specs, only_rank0, RankShard(1, 0, shard_layout(specs, tp_size=1, tp_rank=0)))


def test_bad_specs_are_refused() -> None:
    with pytest.raises(RLError, match="split dim 2"):
        TensorSpec("w", "bfloat16", (4, 4), 2)
    with pytest.raises(RLError, match="negative"):
        TensorSpec("w", "bfloat16", (4, -1), None)
