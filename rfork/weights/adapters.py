"""LoRA adapters as rfork weights: a PEFT adapter directory as named tensors, and an adapter's identity.

An adapter travels like a model: its tensors, plus its `adapter_config.json` as one uint8 tensor, so
the config is digested, anchored and verified with the weights (a peer cannot swap the rank, alpha or
target modules under verified weights). Its identity names the adapter and the base model it was
trained for: two servers share an adapter only when both serve the same base under the same name.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from planner.contract import SourceIdentity
from rfork.errors import ConfigurationError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_TENSOR = "rfork.adapter_config.json"  # the config's bytes, as a uint8 tensor among the weights
FRAMEWORK = "peft-lora"
LAYOUT_VERSION = "v1"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class AdapterError(ConfigurationError):
    """An adapter directory or name rfork cannot serve; the message says which and why."""

    def __init__(self, message: str) -> None:
        super().__init__(message, setting="lora")


def check_adapter_name(name: str) -> str:
    """`name` if it is one safe path component (letters, digits, '.', '_', '-'; at most 128; not
    starting with a dot), else AdapterError: a request's model name becomes a directory name."""
    if not _NAME.fullmatch(name) or ".." in name:
        raise AdapterError(
            f"adapter name {name[:80]!r}: use at most 128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def adapter_identity(*, base: str, name: str, revision: str = "main") -> SourceIdentity:
    """The identity of adapter `name` (at `revision`) for base model `base` (the name or path the
    engine serves it under)."""
    base_key = hashlib.sha256(f"rfork-lora\0{base}".encode()).hexdigest()
    return SourceIdentity(
        model=check_adapter_name(name),
        revision=revision,
        fingerprint=base_key,
        dtype="adapter",
        framework=FRAMEWORK,
        framework_version=LAYOUT_VERSION,
    )


def read_adapter(directory: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors and its config (as CONFIG_TENSOR) from a PEFT directory; AdapterError if
    either file is missing or the config is not a LoRA config."""
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise AdapterError(f"{directory}: a LoRA adapter needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    raw = config_path.read_bytes()
    _check_config(raw, str(config_path))
    tensors = load_file(str(weights_path))
    if CONFIG_TENSOR in tensors:
        raise AdapterError(f"{weights_path}: holds a tensor named {CONFIG_TENSOR}, which rfork reserves")
    tensors[CONFIG_TENSOR] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return tensors


def write_adapter(tensors: Mapping[str, torch.Tensor], directory: Path) -> Path:
    """Write pulled tensors back as a PEFT directory (what the engine loads); the directory."""
    if CONFIG_TENSOR not in tensors:
        raise AdapterError(f"the adapter's tensors lack {CONFIG_TENSOR}")
    raw = tensors[CONFIG_TENSOR].numpy().tobytes()
    _check_config(raw, f"{directory} (pulled)")
    directory.mkdir(parents=True, exist_ok=True)
    weights = {n: t.clone() for n, t in tensors.items() if n != CONFIG_TENSOR}  # views of one buffer
    save_file(weights, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_bytes(raw)
    return directory


def _check_config(raw: bytes, where: str) -> None:
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise AdapterError(f"{where}: {CONFIG_FILE} is not JSON: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterError(f"{where}: not a LoRA adapter config (peft_type must be LORA)")
