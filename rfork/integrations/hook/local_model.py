"""The model as it lies on this host: rfork's view of its local checkpoint, its name and revision."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rfork.errors import CheckpointError
from rfork.weights.checkpoint import CheckpointInfo, read_checkpoint_info

if TYPE_CHECKING:
    from rfork.integrations.hook.settings import HookSettings

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


def identity_model_and_revision(
    settings: HookSettings, model_config: Any, model_path: str
) -> tuple[str, str]:
    """The parameters identity's model and revision: the settings' model name, else the last part of
    the HF config's `_name_or_path` (else of the path); the model config's revision, else the settings'."""
    model = settings.model
    if not model:
        hf = getattr(model_config, "hf_config", None)
        name = getattr(hf, "_name_or_path", None) or model_path
        model = Path(str(name)).name or str(name)
    revision = settings.revision if model_config.revision is None else str(model_config.revision)
    return model, revision
