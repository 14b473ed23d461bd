"""The shapes users run, through `rfork vllm` on vLLM's CPU build (tests/integrations/shapes.py):
- one chain per shape on real servers, both modes, every server's greedy tokens equal to vLLM's own
  disk load of the same shape: a tiny Mixtral at TP=2 (TP and MoE at once) and an int8 W8A8 Llama;
- fp8 W8A8 and int4 W4A16 checkpoints pulled into their parameters, in `vllm.LLM` processes;
- the parameters-mode safety check on a quantized model: it fires on an in-place post-load rewrite.
Each prints the bytes every rank moved beside its shard's size (docs/shapes.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.shapes import seed_a_b_in_both_modes, to_mixtral, to_w4a16, to_w8a8
from tests.vllm.servers import ServerFleet, write_vllm_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

# shape: (how its checkpoint is written from the tiny Llama, vLLM arguments, tensor-parallel size)
SHAPES: dict[str, tuple[Callable[[Path], Path], list[str], int]] = {
    # a Mixtral at TP=2: each rank holds half of every expert (and half the attention and vocab)
    "tp2-moe": (to_mixtral, ["--tensor-parallel-size", "2"], 2),
    "w8a8-int8": (to_w8a8, [], 1),
}


@pytest.fixture
def shape_planner(tmp_path: Path) -> Iterator[Any]:
    """A planner of its own per shape (each test reads every transfer it records)."""
    from planner import PlannerServer
    from planner.contract import PlannerClient

    with (
        PlannerServer(db_url=f"sqlite:///{tmp_path / 'planner.db'}", insecure=True) as srv,
        PlannerClient(srv.url) as client,
    ):
        client.url = srv.url  # type: ignore[attr-defined]
        yield client


@pytest.mark.parametrize("shape", list(SHAPES))
def test_seed_to_a_to_b_in_both_modes_with_vllms_tokens(shape: str, shape_planner: Any, tmp_path: Path
                                                        ) -> None:
    write, server_args, tp = SHAPES[shape]
    model = write(write_vllm_tiny_llama(tmp_path / "model"))
    fleet = ServerFleet(tmp_path / "servers", model, server_args=server_args)
    (tmp_path / "servers").mkdir()
    try:
        facts = seed_a_b_in_both_modes(shape_planner, fleet, model, tp=tp)
    finally:
        fleet.close()
    if tp > 1:  # checkpoint mode: each rank pulls its slice of the checkpoint, not all of it
        assert all(f.ratio <= 1.2 for f in facts["A"] + facts["B"]), facts


_REWRITING_POST_LOAD = """
import json, sys
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsW8A8Int8

process = CompressedTensorsW8A8Int8.process_weights_after_loading

def rewrites_the_scales_in_place(self, layer):  # fault injection (test-only): a post-load step that
    layer.weight_scale.data.mul_(2)            # rewrites a loaded parameter in its own storage
    process(self, layer)

CompressedTensorsW8A8Int8.process_weights_after_loading = rewrites_the_scales_in_place
from tests.vllm.bench_load import child
child(sys.argv[1], "rfork", json.loads(sys.argv[2]), False)
"""


def test_parameters_mode_does_not_serve_a_quantized_model_a_post_load_step_rewrote(
    shape_planner: Any, tmp_path: Path
) -> None:
    """The seed's digests are taken before vLLM's post-load steps and re-checked after them: on the
    int8 W8A8 model, a post-load step that rewrites `weight_scale` in place keeps the instance from
    becoming a seed (the chain above shows the check passing where nothing changes in place)."""
    import json
    import subprocess
    import sys

    from tests.integrations.server_flow import instances
    from tests.vllm.servers import cpu_env

    model = to_w8a8(write_vllm_tiny_llama(tmp_path / "model"))
    script = tmp_path / "rewriting.py"
    script.write_text(_REWRITING_POST_LOAD)
    extra = {"planner_url": shape_planner.url, "mode": "parameters", "transfer_timeout_s": 3}
    env = {**cpu_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the worker in this one process
    out = subprocess.run(
        [sys.executable, str(script), str(model), json.dumps(extra)],
        capture_output=True, text=True, timeout=900, env=env, check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "vLLM's disk loader fills the parameters" in out.stderr
    assert "post-load steps changed the loaded parameters in place" in out.stderr
    assert "serving as seed" not in out.stderr
    assert instances(shape_planner) == []  # never published


@pytest.mark.parametrize(
    ("fmt", "write"),
    [
        pytest.param("fp8", lambda d: to_w8a8(d, "float"), id="fp8"),
        pytest.param("int4", to_w4a16, id="w4a16-int4"),
    ],
)
def test_more_quantized_formats_pull_into_their_parameters(
    fmt: str, write: Callable[[Path], Path], shape_planner: Any, tmp_path: Path
) -> None:
    """Two more checkpoint formats vLLM's CPU build loads (compressed-tensors fp8 W8A8 and int4 W4A16),
    in `vllm.LLM` processes (cheaper than servers): P1 (parameters mode, no seed: vLLM's disk loader)
    becomes a parameters seed, which the safety check allows only if no post-load step rewrote a
    loaded parameter in place; P2 pulls into its parameters from P1; both give vLLM's own tokens."""
    from tests.integrations.shapes import SHAPE_TIMEOUT_S, rank_facts
    from tests.vllm.bench_load import _run_row

    model = write(write_vllm_tiny_llama(tmp_path / "model"))
    auto, _ = _run_row(model, "auto", {}, tmp_path / "auto.log")
    params = {"planner_url": shape_planner.url, "mode": "parameters", "transfer_timeout_s": SHAPE_TIMEOUT_S}
    p1_row, p1 = _run_row(model, "rfork", params, tmp_path / "p1.log", hold=True)
    try:
        p2_row, _ = _run_row(model, "rfork", {**params, "serve": False}, tmp_path / "p2.log")
    finally:
        assert p1.stdin is not None
        p1.stdin.close()
        p1.wait(timeout=120)
    assert p1_row["tokens"] == auto["tokens"]
    assert p2_row["tokens"] == auto["tokens"]
    p1_log = (tmp_path / "p1.log").read_text()
    assert "changed the loaded parameters in place" not in p1_log
    (p2,) = rank_facts("P2", (tmp_path / "p2.log").read_text())
    print(f"{fmt}: P2 {p2.moved} bytes from {p2.source}, shard {p2.shard} bytes ({p2.ratio:.2f}x)")
    assert p2.source == "rfork-tcp"
    assert p2.moved == p2.shard
