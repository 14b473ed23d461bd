"""Expert-parallel MoE dispatch and combine over the engine (docs/moe.md)."""

from backends.moe.expert_parallel import DEFAULT_IMM_BASE, Dispatched, ExpertParallel, MoEError, MoETimeout
from backends.moe.routing import moe_reference

__all__ = ["DEFAULT_IMM_BASE", "Dispatched", "ExpertParallel", "MoEError", "MoETimeout", "moe_reference"]
