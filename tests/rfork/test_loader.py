"""rfork.loader: pulling into a framework's own tensors, refusing a mismatch before any byte
moves, falling back into the same tensors.
"""

from __future__ import annotations

import pytest
import torch

from rfork import Loader, pull_into
from rfork.errors import DestinationMismatch
from rfork.seed.seed import Seed
from rfork.weights.checkpoint import load_state_dict, read_checkpoint_info
from rfork.weights.rank_weights import RankWeights
from rfork.weights.synthetic import write_synthetic_checkpoint
from tests.rfork.conftest import AUTH, REGISTER, SMALL, identity_for, opts, tied_model, tied_seed
from tests.tiny_llama import LlamaForCausalLM


@pytest.mark.slow
def test_serve_in_place_then_pull_into_a_module_then_serve_from_it(planner):
    model = tied_model(0)
    before = {n: t.data_ptr() for n, t in model.state_dict().items()}
    weights = RankWeights.from_tensors(tensors=model.state_dict())
    assert weights.buffers == []  # nothing copied
    ident = identity_for(model)
    with Seed(
        weights=[weights], identity=ident, planner_url=planner, providers=["tcp"], token=REGISTER
    ) as seed:
        assert {n: t.data_ptr() for n, t in model.state_dict().items()} == before  # not re-pointed
        target = tied_model(1)
        ptrs = {n: t.data_ptr() for n, t in target.state_dict().items()}
        loader = Loader(identity=ident, planner_url=planner, options=opts(), **AUTH)
        a = loader.load_into(target)
        try:
            assert a.source == "rfork-tcp"
            assert a.verified
            assert a.attempts[0].instance_id == seed.instance_ids[0]
            assert {n: t.data_ptr() for n, t in target.state_dict().items()} == ptrs  # pulled in place
            for name, t in model.state_dict().items():
                assert torch.equal(target.state_dict()[name], t), name
            # the loaded instance serves its own tensors: a third instance pulls from it
            third = LlamaForCausalLM(SMALL)
            third.lm_head.weight = third.model.embed_tokens.weight
            third.register_buffer("empty_buf", torch.empty(0, 8))
            b = pull_into(
                identity=ident,
                planner_url=planner,
                tensors=third.state_dict(),
                options=opts(exclude=seed.instance_ids, become_seed=False),
                **AUTH,
            )
            assert a.seed is not None
            assert b.attempts[0].instance_id == a.seed.instance_ids[0]
            for name, t in model.state_dict().items():
                assert torch.equal(third.state_dict()[name], t), name
            b.close()
        finally:
            a.close()


@pytest.mark.slow
def test_pull_into_mismatch_fails_before_any_byte_moves(planner):
    with tied_seed(planner) as (model, ident, _seed):
        dest = {n: torch.full_like(t, 7) for n, t in model.state_dict().items()}
        name = "model.layers.1.mlp.up_proj.weight"
        dest[name] = torch.full((3, 3), 7, dtype=torch.bfloat16)
        with pytest.raises(DestinationMismatch, match=name):
            pull_into(
                identity=ident, planner_url=planner, tensors=dest, options=opts(become_seed=False), **AUTH
            )
        assert all(bool((t == 7).all()) for t in dest.values())  # nothing written


@pytest.mark.slow
def test_corrupt_seed_falls_back_to_disk_into_the_same_tensors(tmp_path, planner):
    ckpt = write_synthetic_checkpoint(tmp_path / "ckpt", config=SMALL, shard_bytes=3 << 20)
    info = read_checkpoint_info(ckpt)
    served = {n: t.clone() for n, t in load_state_dict(ckpt).items()}
    weights = RankWeights.from_tensors(tensors=served)
    with Seed(
        weights=[weights], identity=info.identity(), planner_url=planner, control=False, token=REGISTER
    ):
        victim = next(iter(served.values()))
        victim.view(-1)[3] += 1  # after the digests were published
        dest = {n: torch.empty_like(t) for n, t in served.items()}
        ptrs = {n: t.data_ptr() for n, t in dest.items()}
        result = pull_into(
            identity=info.identity(),
            planner_url=planner,
            tensors=dest,
            checkpoint=ckpt,
            options=opts(become_seed=False),
            **AUTH,
        )
        assert result.source == "disk"
        assert not result.verified  # a disk load has nothing to compare digests with
        assert "checksum" in (result.attempts[0].error or "")
        assert {n: t.data_ptr() for n, t in dest.items()} == ptrs
        reference = load_state_dict(ckpt)
        assert all(torch.equal(dest[n], reference[n]) for n in reference)
