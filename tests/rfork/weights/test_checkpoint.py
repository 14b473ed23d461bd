"""rfork.weights.checkpoint and .synthetic: safetensors headers, the disk loader and its TP shards,
synthetic checkpoints.
"""

from __future__ import annotations

import torch

from backends.sharding import shard_range, split_dim
from rfork.weights.checkpoint import load_rank_from_disk, load_state_dict, read_checkpoint_info
from rfork.weights.synthetic import config_for_size, write_synthetic_checkpoint


def test_config_for_size_is_close():
    for size in (20 << 20, 2 << 30):
        cfg = config_for_size(size)
        assert 0.8 < cfg.nbytes() / size < 1.25
        assert cfg.num_hidden_layers >= 4


def test_synthetic_checkpoint_sharded_deterministic_and_loadable(tmp_path):
    cfg = config_for_size(4 << 20)
    a = write_synthetic_checkpoint(tmp_path / "a", config=cfg, shard_bytes=1 << 20)
    b = write_synthetic_checkpoint(tmp_path / "b", config=cfg, shard_bytes=1 << 20)
    assert (a / "model.safetensors.index.json").exists()
    assert len(list(a.glob("*.safetensors"))) > 1
    ia, ib = read_checkpoint_info(a), read_checkpoint_info(b)
    assert ia.fingerprint() == ib.fingerprint()
    assert ia.identity() == ib.identity()
    sa, sb = load_state_dict(a), load_state_dict(b)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert "model.layers.0.self_attn.q_proj.weight" in sa
    assert sa["model.embed_tokens.weight"].dtype == torch.bfloat16
    from safetensors.torch import load_file

    ref = {}
    for f in a.glob("*.safetensors"):
        ref.update(load_file(str(f)))
    assert all(torch.equal(ref[k], sa[k]) for k in ref)


def test_tp_sharding_rule_reassembles(tmp_path):
    cfg = config_for_size(4 << 20)
    d = write_synthetic_checkpoint(tmp_path, config=cfg)
    full = load_state_dict(d)
    parts = [load_state_dict(d, tp=2, rank=r) for r in range(2)]
    for name, t in full.items():
        dim = split_dim(name, t.dim())
        if dim is None:
            assert all(torch.equal(p[name], t) for p in parts)
        else:
            assert torch.equal(torch.cat([p[name] for p in parts], dim), t)
    assert split_dim("model.layers.0.self_attn.o_proj.weight", 2) == 1
    assert split_dim("model.layers.0.mlp.gate_proj.weight", 2) == 0
    assert shard_range(5, 2, 0) == (0, 3)
    assert shard_range(5, 2, 1) == (3, 5)


def test_zero_byte_tensor_survives_checkpoint(tmp_path):
    cfg = config_for_size(2 << 20)
    d = write_synthetic_checkpoint(tmp_path, config=cfg, extra_tensors={"extra.empty": torch.empty(0, 8)})
    layout, _, views = load_rank_from_disk(read_checkpoint_info(d))
    assert views["extra.empty"].shape == (0, 8)
    assert any(p.nbytes == 0 for p in layout.placements)
