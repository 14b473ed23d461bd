"""The SGLang startup hook: `--load-format rfork` for an unmodified SGLang server (docs/sglang.md).

`rfork.integrations.sglang.plugin.register` is the `sglang.srt.plugins` entry point. This package
imports nothing heavy at the top level: SGLang loads the plugin in every one of its processes.
"""
