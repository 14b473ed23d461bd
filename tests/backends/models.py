"""Model-shaped data for the transport's tests: a Llama's tensor list, reproducible weights, host buffers.

The KV tests decode with a real small Llama (tests/tiny_llama.py) and the RL tests move a Llama's
tensors. rfork.weights makes the same things for checkpoints, but the transport's tests run without
rfork (tests/test_house.py), so they take them from here.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backends.layout import Layout, dtype_from_name


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """A Llama's shape (the Hugging Face config fields a test reads)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def tensor_specs(self, dtype: str = "bfloat16") -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every weight, in the usual Llama checkpoint order (lm_head untied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = self.num_key_value_heads * self.head_dim
        specs: list[tuple[str, str, tuple[int, ...]]] = [("model.embed_tokens.weight", dtype, (v, h))]
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            specs += [
                (p + "input_layernorm.weight", dtype, (h,)),
                (p + "self_attn.q_proj.weight", dtype, (h, h)),
                (p + "self_attn.k_proj.weight", dtype, (kv, h)),
                (p + "self_attn.v_proj.weight", dtype, (kv, h)),
                (p + "self_attn.o_proj.weight", dtype, (h, h)),
                (p + "post_attention_layernorm.weight", dtype, (h,)),
                (p + "mlp.gate_proj.weight", dtype, (i, h)),
                (p + "mlp.up_proj.weight", dtype, (i, h)),
                (p + "mlp.down_proj.weight", dtype, (h, i)),
            ]
        return [*specs, ("model.norm.weight", dtype, (h,)), ("lm_head.weight", dtype, (v, h))]


def synthetic_tensor(name: str, dtype: str, shape: Sequence[int], *, seed: int = 0) -> torch.Tensor:
    """Deterministic pseudo-random weights for one tensor (depends on name, shape and seed only):
    norms near 1, the rest normal with std 0.02, as a checkpoint generator makes them."""
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) << 16) ^ seed)
    dt = dtype_from_name(dtype)
    if name.endswith("norm.weight"):
        return (1.0 + torch.empty(tuple(shape), dtype=torch.float32).uniform_(-0.1, 0.1, generator=g)).to(dt)
    return torch.empty(tuple(shape), dtype=dt).normal_(0.0, 0.02, generator=g)


def allocate(layout: Layout) -> list[torch.Tensor]:
    """One uninitialised flat uint8 host buffer per region of `layout`."""
    return [torch.empty(n, dtype=torch.uint8) for n in layout.region_sizes]
