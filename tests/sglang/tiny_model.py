"""A tiny Llama checkpoint that SGLang can serve: config.json, safetensors and a local word tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from rfork.weights.synthetic import LlamaConfig, write_synthetic_checkpoint

TINY = LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)
SPECIAL = ["<unk>", "<s>", "</s>"]


def write_tiny_llama(directory: Path, *, name: str = "tiny-llama", config: LlamaConfig = TINY) -> Path:
    """Write the model (default: TINY) to `directory` (no hub access) and return it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

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
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), config.vocab_size)})
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
