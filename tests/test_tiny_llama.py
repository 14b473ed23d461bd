"""tests.tiny_llama: the small real Llama the end-to-end tests compare logits with."""

from __future__ import annotations

import torch

from rfork.weights.checkpoint import load_state_dict
from rfork.weights.synthetic import config_for_size, write_synthetic_checkpoint
from tests.tiny_llama import LlamaForCausalLM


def test_model_runs_and_is_deterministic(tmp_path):
    cfg = config_for_size(2 << 20)
    d = write_synthetic_checkpoint(tmp_path, config=cfg)
    m1, m2 = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg)
    m1.load_state_dict(load_state_dict(d), assign=True)
    m2.load_state_dict(load_state_dict(d), assign=True)
    ids = torch.arange(16).view(2, 8) % cfg.vocab_size
    with torch.no_grad():
        out1, out2 = m1(ids), m2(ids)
    assert out1.shape == (2, 8, cfg.vocab_size)
    assert torch.isfinite(out1.float()).all()
    assert torch.equal(out1, out2)
