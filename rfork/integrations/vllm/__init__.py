"""The vLLM startup hook: `--load-format rfork` for an unmodified vLLM server (docs/vllm.md).

`rfork.integrations.vllm.plugin.register` is the `vllm.general_plugins` entry point. This package
imports nothing heavy at the top level: vLLM loads the plugin in every one of its processes.
"""
