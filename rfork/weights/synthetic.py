"""Synthetic Llama-shaped checkpoints: a config of any size and deterministic weights in safetensors.

What `rfork demo`, the benchmarks and the tests serve and load; the tensor names match Llama
checkpoints, so the sharding rule and real model code apply to them unchanged.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from backends import dtype_from_name, expected_nbytes
from rfork.errors import CheckpointError
from rfork.weights.checkpoint import INDEX_NAME

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.__dict__,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "torch_dtype": "bfloat16",
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        keys = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in keys})

    def tensor_specs(self, dtype: str = "bfloat16") -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every weight, in the usual Llama checkpoint order."""
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
        specs.append(("model.norm.weight", dtype, (h,)))
        if not self.tie_word_embeddings:
            specs.append(("lm_head.weight", dtype, (v, h)))
        return specs

    def nbytes(self, dtype: str = "bfloat16") -> int:
        return sum(expected_nbytes(dtype_from_name(d), s) for _, d, s in self.tensor_specs(dtype))


def config_for_size(target_bytes: int) -> LlamaConfig:
    """A Llama-proportioned bf16 config (intermediate ~2.7x hidden, head_dim 64, GQA 4:1) near target_bytes.

    Picks the widest hidden size that still gives at least 8 layers.
    """
    best = _cfg(128, 2, 1)
    for hidden in (128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 5120, 8192):
        one, two = _cfg(hidden, hidden // 64, 1).nbytes(), _cfg(hidden, hidden // 64, 2).nbytes()
        per_layer, base = two - one, 2 * one - two
        layers = round((target_bytes - base) / per_layer)
        if layers < 8 and hidden > 128:
            break
        best = _cfg(hidden, hidden // 64, max(layers, 1))
    return best


def _cfg(hidden: int, heads: int, layers: int) -> LlamaConfig:
    inter = ((hidden * 8 // 3) + 63) // 64 * 64
    vocab = min(32000, hidden * 16)
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 2),
        vocab_size=vocab,
    )


def synthetic_tensor(name: str, dtype: str, shape: Sequence[int], *, seed: int = 0) -> torch.Tensor:
    """Deterministic pseudo-random weights for one tensor (depends on name, shape and seed only)."""
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) << 16) ^ seed)
    dt = dtype_from_name(dtype)
    if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
        return (1.0 + torch.empty(tuple(shape), dtype=torch.float32).uniform_(-0.1, 0.1, generator=g)).to(dt)
    return torch.empty(tuple(shape), dtype=dt).normal_(0.0, 0.02, generator=g)


def write_synthetic_checkpoint(
    directory: str | Path,
    *,
    config: LlamaConfig | None = None,
    size_bytes: int | None = None,
    shard_bytes: int = 512 << 20,
    model_name: str | None = None,
    seed: int = 0,
    extra_tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write config.json, model-0000k-of-0000n.safetensors shards and the index json; returns the dir."""
    if config is None:
        if size_bytes is None:
            raise CheckpointError("give a config or a size")
        config = config_for_size(size_bytes)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    name = model_name or f"synthetic-llama-h{config.hidden_size}-l{config.num_hidden_layers}"
    (out / "config.json").write_text(json.dumps({**config.to_dict(), "_name_or_path": name}, indent=1))
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    items: list[tuple[str, torch.Tensor]] = [
        (n, synthetic_tensor(n, d, s, seed=seed)) for n, d, s in config.tensor_specs()
    ]
    items += list((extra_tensors or {}).items())
    for n, t in items:
        nb = t.numel() * t.element_size()
        if shards[-1] and used + nb > shard_bytes:
            shards.append({})
            used = 0
        shards[-1][n] = t.contiguous()
        used += nb
    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for n, t in shard.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    (out / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    log.info(
        "wrote synthetic checkpoint %s: %d tensors, %d bytes, %d shard(s)",
        out,
        len(weight_map),
        total,
        len(shards),
    )
    return out


SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def write_servable_llama(directory: Path, *, config: LlamaConfig, name: str = "tiny-llama") -> Path:
    """A synthetic Llama that a serving engine (SGLang, vLLM) can start from with no hub access: the
    checkpoint, the config fields the engines read, and a local word tokenizer (`w3`..`w<vocab-1>`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # the engines' dependency, not rfork's

    write_synthetic_checkpoint(directory, config=config, model_name=name, seed=11)
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        hidden_act="silu",
        initializer_range=0.02,
        use_cache=True,
        head_dim=config.head_dim,
    )
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), config.vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 512,
            }
        )
    )
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return directory


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_synthetic_lora(
    directory: Path,
    *,
    config: LlamaConfig,
    base_model: str,
    seed: int,
    rank: int = 8,
    targets: Sequence[str] = ("q_proj", "v_proj"),
) -> Path:
    """A PEFT LoRA adapter for a Llama of `config` (bf16, `rank`, on `targets` of every layer), as PEFT
    writes it: random enough to change the tokens. `base_model` is what the engine calls the base (vLLM:
    its model path)."""
    gen = torch.Generator().manual_seed(seed)
    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    dims = {  # (in, out)
        "q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
        "gate_proj": (h, config.intermediate_size), "up_proj": (h, config.intermediate_size),
        "down_proj": (config.intermediate_size, h),
    }  # fmt: skip
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        for module in targets:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            fan_in, fan_out = dims[module]
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * 0.5).bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.5).bfloat16()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
    return directory
