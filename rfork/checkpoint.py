"""Deprecated module path: import from `rfork` (`from rfork import read_checkpoint_info, CheckpointInfo`).

Kept so code written against the README of rfork 0.1 keeps working; it warns once per process.
"""

import warnings

from rfork.weights.checkpoint import CheckpointInfo, load_state_dict, read_checkpoint_info

warnings.warn("rfork.checkpoint is deprecated: import from rfork instead", DeprecationWarning, stacklevel=2)

__all__ = ["CheckpointInfo", "load_state_dict", "read_checkpoint_info"]
