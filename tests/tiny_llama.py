"""A small, real Llama-style transformer (RMSNorm, RoPE, GQA attention, SwiGLU MLP) built from a config.

Its parameter names match the checkpoint generator's, so `load_state_dict` takes what a seed serves.
Used by the end-to-end tests: identical weights must give bit-identical logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypedDict, cast

import torch
from torch import nn


class LlamaShape(TypedDict):
    """A Llama's shape, as keyword arguments of either LlamaConfig (rfork's, or the transport tests')."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int


# The suite's small Llama (~8.6 MB in bf16): `LlamaConfig(**SMALL)` with rfork.weights.synthetic's
# config (tests/rfork) or tests.backends.models' (the transport's tests, which run without rfork).
SMALL: LlamaShape = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
}


class LlamaConfig(Protocol):
    """The config fields the model reads: rfork.weights.synthetic.LlamaConfig has them, and so has
    tests.backends.models.LlamaConfig, for the transport's tests that run without rfork."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def head_dim(self) -> int: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def _rope(x: torch.Tensor, theta: float, start: int = 0) -> torch.Tensor:
    _, _, seq, dim = x.shape
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    ang = torch.outer(torch.arange(start, start + seq, dtype=torch.float32), inv)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def qkv(self, x: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as (batch, heads, seq, head_dim), rotated for positions start.. (k before GQA repeat)."""
        b, s, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b, s, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return _rope(q, c.rope_theta, start), _rope(k, c.rope_theta, start), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
        """Attention of q over (k, v), GQA heads repeated, projected back to the hidden size."""
        b, _, s, _ = q.shape
        rep = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x)
        return self.attend(q, k, v, causal=True)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Names: model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight, ..., lm_head.weight."""

    def __init__(self, cfg: LlamaConfig, *, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.to(dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(ids))


class PagedKvCache:
    """One sequence's K/V in a paged pool shaped (layers, 2, pages, page_tokens, kv_heads, head_dim).

    Token t of the sequence lives in slot t % page_tokens of page page_ids[t // page_tokens]; the
    pool is what backends.kv registers and transfers (page_bytes = page_tokens * kv_heads * head_dim
    * element size), so a receiver decodes from exactly the bytes the sender wrote.
    """

    def __init__(self, pool: torch.Tensor, page_ids: list[int]) -> None:
        if pool.dim() != 6 or pool.shape[1] != 2:
            raise ValueError(
                f"pool must be (layers, 2, pages, page_tokens, kv_heads, head_dim), not {tuple(pool.shape)}"
            )
        self.pool = pool
        self.page_ids = list(page_ids)
        self.page_tokens = int(pool.shape[3])

    @staticmethod
    def allocate(
        cfg: LlamaConfig, pages: int, page_tokens: int, dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        """A zeroed pool tensor for cfg's layers and KV heads."""
        shape = (cfg.num_hidden_layers, 2, pages, page_tokens, cfg.num_key_value_heads, cfg.head_dim)
        return torch.zeros(shape, dtype=dtype)

    @property
    def capacity(self) -> int:
        """Tokens the sequence's pages hold."""
        return len(self.page_ids) * self.page_tokens

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v of shape (kv_heads, seq, head_dim) for positions start.. of layer."""
        seq = k.shape[1]
        if start + seq > self.capacity:
            raise ValueError(f"positions {start}..{start + seq - 1} exceed the {self.capacity}-token cache")
        kt, vt = k.transpose(0, 1), v.transpose(0, 1)  # (seq, kv_heads, head_dim)
        pos = start
        while pos < start + seq:
            page, slot = self.page_ids[pos // self.page_tokens], pos % self.page_tokens
            n = min(self.page_tokens - slot, start + seq - pos)
            self.pool[layer, 0, page, slot : slot + n] = kt[pos - start : pos - start + n]
            self.pool[layer, 1, page, slot : slot + n] = vt[pos - start : pos - start + n]
            pos += n

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of positions 0..length-1 of layer, each (kv_heads, length, head_dim)."""
        npages = -(-length // self.page_tokens)
        ids = torch.tensor(self.page_ids[:npages], dtype=torch.long)
        k = self.pool[layer, 0].index_select(0, ids).flatten(0, 1)[:length]
        v = self.pool[layer, 1].index_select(0, ids).flatten(0, 1)[:length]
        return k.transpose(0, 1), v.transpose(0, 1)


def _decoder_layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    return [cast(DecoderLayer, m) for m in model.model.layers]


@torch.no_grad()
def prefill(model: LlamaForCausalLM, ids: torch.Tensor, cache: PagedKvCache) -> torch.Tensor:
    """Run the prompt ids (1-D) through the model, keeping every layer's K/V in cache; last logits."""
    x = model.model.embed_tokens(ids.unsqueeze(0))
    for i, layer in enumerate(_decoder_layers(model)):
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(x))
        cache.write(i, 0, k[0], v[0])
        x = x + attn.attend(q, k, v, causal=True)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x))[0, -1]


@torch.no_grad()
def decode_step(
    model: LlamaForCausalLM,
    token: int,
    pos: int,
    cache: PagedKvCache,
    before_layer: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Logits for `token` at position pos, attending to cache positions 0..pos (its K/V is appended).

    before_layer(i), if given, runs before layer i reads the cache: a receiver waits there for
    layer i to land, so decoding starts while later layers are still in flight.
    """
    x = model.model.embed_tokens(torch.tensor([[token]]))
    for i, layer in enumerate(_decoder_layers(model)):
        if before_layer is not None:
            before_layer(i)
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(x), start=pos)
        cache.write(i, pos, k[0], v[0])
        kc, vc = cache.read(i, pos + 1)
        x = x + attn.attend(q, kc.unsqueeze(0), vc.unsqueeze(0), causal=False)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x))[0, -1]


def greedy_decode(
    model: LlamaForCausalLM,
    first_token: int,
    start: int,
    steps: int,
    cache: PagedKvCache,
    before_layer: Callable[[int], None] | None = None,
) -> list[int]:
    """Greedy tokens: first_token at position start, then steps-1 more, reading K/V from cache."""
    out = [first_token]
    with torch.no_grad():
        for step in range(steps - 1):
            logits = decode_step(model, out[-1], start + step, cache, before_layer if step == 0 else None)
            out.append(int(logits.float().argmax()))
    return out
