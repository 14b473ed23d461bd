"""A tiny Llama checkpoint that SGLang can serve: config.json, safetensors and a local word tokenizer."""

from __future__ import annotations

from pathlib import Path

from rfork.weights.synthetic import LlamaConfig, write_servable_llama

# not tests.tiny_llama.SMALL, on purpose: a 2-layer, 64-wide Llama (head dim 16) that a real SGLang
# server loads and answers with on CPU, well below the small model's size
TINY = LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)


def write_tiny_llama(directory: Path, *, name: str = "tiny-llama", config: LlamaConfig = TINY) -> Path:
    """Write the model (default: TINY) to `directory` (no hub access) and return it."""
    return write_servable_llama(directory, config=config, name=name)
