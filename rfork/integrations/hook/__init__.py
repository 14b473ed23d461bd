"""What the SGLang and vLLM hooks share: settings, identities, the local checkpoint, seeding, drains,
and the launchers' flags.

Each framework package (`rfork.integrations.sglang`, `rfork.integrations.vllm`) keeps only what
touches its framework. This package imports nothing at the top level: both frameworks load their
plugin in every one of their processes.
"""
