"""The `vllm.general_plugins` entry point: registers the `rfork` load format with vLLM.

vLLM calls `register()` in every one of its processes (API server, engine core, workers) and may call
it more than once, so it only puts `RforkModelLoader` in vLLM's loader registry, once. The loader
module imports vLLM's own loader base (vLLM imports it anyway to load a model) and rfork's settings;
rfork's transport, planner and seed modules load only when a model loads with `--load-format rfork`.
"""

from __future__ import annotations

LOAD_FORMAT = "rfork"


def register() -> None:
    """Entry point: make `--load-format rfork` resolve to rfork's loader (idempotent)."""
    from vllm.model_executor import model_loader

    # imported here: vLLM imports the plugin in each of its processes (start-up time)
    from rfork.integrations.vllm.model_loader import RforkModelLoader

    if model_loader._LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not RforkModelLoader:
        model_loader.register_model_loader(LOAD_FORMAT)(RforkModelLoader)
