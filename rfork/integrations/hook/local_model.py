"""The model as it lies on this host: rfork's view of its local checkpoint, and its identity name."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rfork.errors import CheckpointError
from rfork.weights.checkpoint import CheckpointInfo, read_checkpoint_info

log = logging.getLogger(__name__)


def local_checkpoint(model_path: str) -> CheckpointInfo | None:
    """rfork's view of a local safetensors checkpoint (headers only), or None."""
    path = Path(model_path)
    if not path.is_dir():
        return None
    try:
        info = read_checkpoint_info(path)
    except (CheckpointError, OSError, ValueError) as exc:
        log.info("rfork: %s is not a checkpoint rfork can read: %s", path, exc)
        return None
    return info if info.tensors else None


def model_name(model_config: Any, model_path: str) -> str:
    """The identity's model name: the last part of the HF config's `_name_or_path`, else of the path."""
    hf = getattr(model_config, "hf_config", None)
    name = getattr(hf, "_name_or_path", None) or model_path
    return Path(str(name)).name or str(name)
