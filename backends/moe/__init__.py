"""Expert-parallel MoE dispatch and combine over the engine (docs/moe.md)."""

from backends.moe.expert_parallel import Dispatched, ExpertParallel, MoEError, MoETimeout
from backends.moe.routing import moe_reference

__all__ = ["Dispatched", "ExpertParallel", "MoEError", "MoETimeout", "moe_reference"]
