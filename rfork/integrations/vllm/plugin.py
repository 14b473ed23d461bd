"""The `vllm.general_plugins` entry point: registers the `rfork` load format with vLLM.

vLLM calls `register()` in every one of its processes (API server, engine core, workers) and may call
it more than once, so it only puts `RforkModelLoader` in vLLM's loader registry, once, and in the
root process arms the drain of the seeds its children publish (rfork.integrations.hook.drain). With
runtime LoRA loading on it also registers rfork's LoRA resolver (adapters from peers). The loader
module imports vLLM's own loader base (vLLM imports it anyway to load a model) and rfork's settings;
rfork's transport, planner and seed modules load only when a model loads with `--load-format rfork`.
"""

from __future__ import annotations

import logging
import os

LOAD_FORMAT = "rfork"


def register() -> None:
    """Entry point: make `--load-format rfork` resolve to rfork's loader (idempotent)."""
    from vllm.model_executor import model_loader

    # imported here: vLLM imports the plugin in each of its processes (start-up time)
    from rfork.integrations.hook import drain
    from rfork.integrations.vllm.model_loader import RforkModelLoader

    if model_loader._LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not RforkModelLoader:
        model_loader.register_model_loader(LOAD_FORMAT)(RforkModelLoader)
    register_kv_connector()
    register_lora_resolver()
    drain.arm_drain_in_main_process()
    show_rfork_logs()


KV_CONNECTOR = "RforkKvConnector"


def register_kv_connector() -> None:
    """Make `"kv_connector": "RforkKvConnector"` resolve without kv_connector_module_path (lazily: the
    connector module loads only when a server uses it)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if KV_CONNECTOR not in KVConnectorFactory._registry:
        module = "rfork.integrations.vllm.kv_connector"
        KVConnectorFactory.register_connector(KV_CONNECTOR, module, KV_CONNECTOR)


def register_lora_resolver() -> None:
    """With runtime LoRA loading on (VLLM_ALLOW_RUNTIME_LORA_UPDATING), resolve unknown adapters from
    peers (rfork.integrations.vllm.lora_resolver); otherwise nothing of it is even imported."""
    from vllm import envs

    if not envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        return
    # imported here: only servers that resolve adapters at run time load it (start-up time)
    from rfork.integrations.vllm.lora_resolver import register_lora_resolver as register_resolver

    register_resolver()


def show_rfork_logs() -> None:
    """vLLM configures only its own "vllm" logger, so rfork's INFO lines (where the weights came from,
    the seed, the drain) would be dropped; print them the way vLLM prints its own, at its level."""
    log = logging.getLogger("rfork")
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    fmt = logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S")
    handler.setFormatter(fmt)
    log.addHandler(handler)
    log.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    log.propagate = False
