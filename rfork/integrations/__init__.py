"""Framework hooks: serving engines that load by R-Fork and become seeds (SGLang, vLLM).

`hook/` holds what both hooks share; `sglang/` and `vllm/` only what touches their framework.
"""
