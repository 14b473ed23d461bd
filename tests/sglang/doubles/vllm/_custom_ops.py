"""TEST DOUBLE for `vllm._custom_ops.rotary_embedding`, in pure torch, so a tiny Llama serves on CPU.

SGLang 0.5.23 on a CPU-only machine (without `SGLANG_USE_CPU_ENGINE`, whose sgl_kernel build the package
index lacks) falls back to vLLM's rotary kernel. These tests put this directory on the server's
PYTHONPATH instead of installing vLLM. Semantics as the vLLM op: rotate, in place, the first
`rotary_dim` channels of every head of `query` and `key` ([tokens, heads * head_size]) by the angles
at `positions`; `cos_sin_cache` is [max_position, rotary_dim] with cos then sin.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, neox: bool) -> None:
    tokens = x.shape[0]
    heads = x.view(tokens, -1, head_size)
    rot = cos.shape[-1] * 2
    part = heads[..., :rot].float()
    c, s = cos[:, None, :].float(), sin[:, None, :].float()
    if neox:
        x1, x2 = part[..., : rot // 2], part[..., rot // 2 :]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:
        x1, x2 = part[..., 0::2], part[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    heads[..., :rot] = out.to(x.dtype)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    cos_sin = cos_sin_cache.index_select(0, positions.reshape(-1).long())
    cos, sin = cos_sin.chunk(2, dim=-1)
    _rotate(query, cos, sin, head_size, is_neox)
    if key is not None:
        _rotate(key, cos, sin, head_size, is_neox)
