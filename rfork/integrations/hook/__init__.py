"""What the SGLang and vLLM hooks share: the model loaders' template (`loader_base`), settings,
identities, the local checkpoint, pulling, seeding, drains, and the launchers' flags.

Each framework package (`rfork.integrations.sglang`, `rfork.integrations.vllm`) keeps only what
touches its framework: a new framework's hook is its package (`__init__`, `plugin`, `model_loader`,
a subclass of `loader_base.RforkLoaderBase`) and its launcher (`rfork/cli/<framework>.py`).
This package imports nothing at the top level: both frameworks load their plugin in every one of
their processes.
"""
