"""Tiny LoRA adapters for the tiny Llama, written as PEFT writes them (what vLLM's resolvers load)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from rfork.weights.synthetic import LlamaConfig

TARGETS = ("q_proj", "v_proj")


def write_adapter(directory: Path, config: LlamaConfig, *, base_model: str, seed: int, rank: int = 8) -> Path:
    """A LoRA adapter of `rank` on q_proj and v_proj of every layer, random enough to change the tokens."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = config.hidden_size // config.num_attention_heads
    out_dims = {"q_proj": config.hidden_size, "v_proj": config.num_key_value_heads * head_dim}
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        for module in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(rank, config.hidden_size, generator=gen) * 0.5
            b = torch.randn(out_dims[module], rank, generator=gen) * 0.5
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
    return directory
