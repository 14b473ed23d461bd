"""Compile caches beside the weights: what an engine compiled, keyed, packed, served and installed.

`key` says when a compiled artifact is valid (identity, engine, torch, compile settings, CPU/GPU);
`archive` packs a cache directory into a digested tar and unpacks a peer's archive safely; `shelf`
is a seed's view of the caches it serves; `fetch` asks the planner for seeds holding a key and
installs the first archive that verifies (docs/vllm.md, "Compile caches").
"""
