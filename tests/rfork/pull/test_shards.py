"""A TP rank's slice from seeds of the whole tensors: only its bytes move, and every one is verified.

End to end: a planner, a `rfork seed --checkpoint` process (TP=1, publishing stripe digests) and loaders
of the TP=2 checkpoint identity, over tcp on loopback; a tampered seed is in process, so that the test
can change the bytes it serves after it published their digests.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from rfork import Loader
from rfork.seed.seed import Seed
from rfork.weights.checkpoint import load_rank_from_disk, read_checkpoint_info
from rfork.weights.rank_weights import RankWeights
from tests.rfork.conftest import AUTH, REGISTER, assert_same, opts, start_seed

pytestmark = pytest.mark.usefixtures("planner")
NO_SEEDING = opts(become_seed=False)


def _slice(ckpt: Path, tp: int, rank: int) -> tuple[dict[str, torch.Tensor], int]:
    """What the disk loader reads for the rank, and its bytes."""
    layout, _, tensors = load_rank_from_disk(read_checkpoint_info(ckpt), tp=tp, rank=rank)
    return tensors, layout.total_bytes


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tp2_rank_reads_only_its_slice_from_a_tp1_seed(
    planner: str, fleet, small_ckpt: Path, rank: int
) -> None:
    start_seed(fleet, small_ckpt, planner)  # TP=1: whole tensors, with stripe digests
    want, shard_bytes = _slice(small_ckpt, 2, rank)
    dest = {name: torch.full_like(t, 7) for name, t in want.items()}
    identity = read_checkpoint_info(small_ckpt).identity(tp=2)

    loader = Loader(identity=identity, planner_url=planner, options=NO_SEEDING, **AUTH)
    result = loader.pull_into(dest, rank=rank)

    assert_same(dest, want)
    assert result.verified
    assert result.source == "rfork-tcp"
    (attempt,) = result.attempts
    assert attempt.ok
    assert attempt.bytes == shard_bytes
    full = read_checkpoint_info(small_ckpt).total_bytes
    assert shard_bytes < 0.6 * full  # the norms are whole in both ranks; the rest is halved


def test_a_tp4_rank_allocates_and_reads_its_slice(planner: str, fleet, small_ckpt: Path) -> None:
    start_seed(fleet, small_ckpt, planner)
    want, shard_bytes = _slice(small_ckpt, 4, 3)
    identity = read_checkpoint_info(small_ckpt).identity(tp=4)

    result = Loader(identity=identity, planner_url=planner, options=NO_SEEDING, **AUTH).load([3])

    assert_same(result.ranks[3].weights.tensors, want)
    assert result.verified
    assert result.bytes == shard_bytes


def test_a_tampered_stripe_fails_the_rank_that_reads_it_and_no_other(planner: str, small_ckpt: Path) -> None:
    info = read_checkpoint_info(small_ckpt)
    layout, buffers, tensors = load_rank_from_disk(info)
    served = RankWeights(layout=layout, buffers=buffers, tensors=tensors, rank=0)
    with Seed(weights=[served], identity=info.identity(), planner_url=planner, token=REGISTER):
        # after publication: the last column of a row-parallel tensor, which only rank 1 of TP=2 holds
        served.tensors["model.layers.1.self_attn.o_proj.weight"][:, -1] += 1
        identity = info.identity(tp=2)
        results = {}
        for rank in (0, 1):
            want, _ = _slice(small_ckpt, 2, rank)
            dest = {name: torch.empty_like(t) for name, t in want.items()}
            loader = Loader(
                identity=identity, planner_url=planner, checkpoint=small_ckpt, options=NO_SEEDING, **AUTH
            )
            results[rank] = loader.pull_into(dest, rank=rank)
            assert_same(dest, want)  # rank 1 from the disk, after its read failed

    assert results[0].source == "rfork-tcp"
    assert results[0].verified
    assert results[1].source == "disk"
    assert not results[1].verified
    failed = results[1].attempts[0]
    assert not failed.ok
    assert failed.error is not None
    assert "model.layers.1.self_attn.o_proj.weight#stripe7" in failed.error


def test_a_seed_without_stripes_leaves_the_slice_to_the_disk(planner: str, small_ckpt: Path) -> None:
    info = read_checkpoint_info(small_ckpt)
    layout, buffers, tensors = load_rank_from_disk(info)
    served = RankWeights(layout=layout, buffers=buffers, tensors=tensors, rank=0)
    # another layout's identity (not the checkpoint layout at TP=1) publishes no stripes: a TP=2 rank of
    # it has no whole-tensor seeds to read a slice from, and its own identity has no seed at all
    with Seed(weights=[served], identity=info.identity(), planner_url=planner, token=REGISTER):
        identity = info.identity(tp=2, model="another-name")
        want, _ = _slice(small_ckpt, 2, 0)
        dest = {name: torch.empty_like(t) for name, t in want.items()}
        loader = Loader(
            identity=identity, planner_url=planner, checkpoint=small_ckpt, options=NO_SEEDING, **AUTH
        )
        result = loader.pull_into(dest, rank=0)
    assert result.source == "disk"
    assert_same(dest, want)


def test_an_operator_anchors_both_layouts_and_a_slice_reader_serves_its_slice(
    planner: str, fleet, small_ckpt: Path
) -> None:
    from planner.contract import PlannerClient
    from rfork.cli.digest import anchor_bodies
    from tests.rfork.conftest import ADMIN

    with PlannerClient(planner, token=ADMIN) as admin:
        for tp in (1, 2):  # what `rfork anchor upload --checkpoint DIR --tp N` sends
            args = argparse.Namespace(checkpoint=small_ckpt, tp=tp, revision="main", model_name=None)
            for body in anchor_bodies(args):
                admin.put_anchor(body)
    _, whole_seed = start_seed(fleet, small_ckpt, planner)  # its stripes must match the uploaded anchor
    identity = read_checkpoint_info(small_ckpt).identity(tp=2)
    want, shard_bytes = _slice(small_ckpt, 2, 1)
    first = {name: torch.empty_like(t) for name, t in want.items()}
    one = Loader(identity=identity, planner_url=planner, options=opts(), **AUTH).pull_into(first, rank=1)
    try:
        assert one.source == "rfork-tcp"
        assert one.bytes == shard_bytes
        assert one.seed is not None, one.seed_error  # a seed of the TP=2 layout's rank 1 now
        fleet.stop(whole_seed)
        second = {name: torch.empty_like(t) for name, t in want.items()}
        reader = Loader(identity=identity, planner_url=planner, options=NO_SEEDING, **AUTH)
        two = reader.pull_into(second, rank=1)
        assert_same(second, want)
        assert two.source == "rfork-tcp"
        assert two.verified
        assert two.attempts[-1].instance_id in one.seed.instance_ids
        assert two.bytes == shard_bytes
    finally:
        one.close()


def test_a_slice_no_stripes_make_up_goes_to_the_disk_after_one_seed(planner: str, small_ckpt: Path) -> None:
    info = read_checkpoint_info(small_ckpt)
    seeds = []
    for _ in range(2):  # two seeds of the whole tensors: the refusal is the manifest's, so one try is enough
        layout, buffers, tensors = load_rank_from_disk(info)
        weights = RankWeights(layout=layout, buffers=buffers, tensors=tensors, rank=0)
        seed = Seed(weights=[weights], identity=info.identity(), planner_url=planner, token=REGISTER)
        seeds.append(seed.start())
    try:
        want, _ = _slice(small_ckpt, 3, 2)  # 8 stripes per tensor: TP=3 holds no whole ones
        dest = {name: torch.empty_like(t) for name, t in want.items()}
        loader = Loader(
            identity=info.identity(tp=3), planner_url=planner, checkpoint=small_ckpt, options=NO_SEEDING,
            **AUTH,
        )
        result = loader.pull_into(dest, rank=2)
    finally:
        for seed in seeds:
            seed.close()
    assert result.source == "disk"
    assert_same(dest, want)
    (refused, disk) = result.attempts
    assert refused.error is not None
    assert "publishes no stripes that make up rank 2 of TP=3" in refused.error
    assert disk.source == "disk"
