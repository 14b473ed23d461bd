"""Real vLLM servers on CPU loading a tiny Llama with `rfork vllm` (one flow, servers shared).

Steps (each needs the ones before; servers start in pairs where independent, to save time; test n
runs the steps through n that have not run yet, so it runs alone too: tests/integrations/server_flow.py):
  1. `--load-format auto` (the reference tokens) beside A, which pulls from an `rfork seed` over tcp;
  2. A became a seed: the rfork seed drains, and B pulls from A (checkpoint mode, chain);
     beside it P1 in parameters mode finds no parameters seed and fills its parameters from disk;
  3. P2 pulls straight into its parameters from P1; beside it, after A and B were SIGKILLed (still
     READY in the planner), C fails over across both dead seeds and loads from disk;
  4. SIGTERM drains P1; `/v1/transfers` shows every pull, failures included;
  5. P2 is SIGKILLed: P3 (parameters mode) fails over the dead seed and vLLM's disk loader fills its
     parameters; beside it D (checkpoint mode) gets a `.bin` copy rfork cannot read and loads with
     vLLM's DefaultModelLoader;
  6. a `vllm.LLM` pulls from C, then vLLM's `load_weights` rejects the tensors (an unknown one is
     injected): vLLM's disk loader fills the same model.
Every server's generated tokens equal the `auto` server's for the same prompt.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from tests.integrations.server_flow import (
    Flow,
    chain_and_parameters_mode_without_a_seed,
    ids_by_framework,
    instances,
    parameters_pull_and_failover_past_sigkilled_seeds,
    pull_from_an_rfork_seed_and_match_auto,
    transfers,
)
from tests.vllm.servers import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2400)]

RESULTS_ENV = "RFORK_VLLM_RESULTS"  # optional: write the measured load times here as JSON


def _step_1(flow: Flow[VllmServer]) -> None:
    pull_from_an_rfork_seed_and_match_auto(flow)


def _step_2(flow: Flow[VllmServer]) -> None:
    chain_and_parameters_mode_without_a_seed(
        flow, framework="vllm", fallback_line="vLLM's disk loader fills the parameters"
    )
    p1_seeds = set(flow.seed_ids["P1"])
    (p1_identity,) = [i["identity"] for i in instances(flow.planner) if i["id"] in p1_seeds]
    assert p1_identity["framework_version"] == "0.32.0"
    assert (p1_identity["tp"], p1_identity["pp"], p1_identity["dtype"]) == (1, 1, "bfloat16")
    assert (p1_identity["quantization"], p1_identity["device_kind"]) == ("none", "cpu")


def _step_3(flow: Flow[VllmServer]) -> None:
    p2, _ = parameters_pull_and_failover_past_sigkilled_seeds(flow)
    assert "rfork: parameters mode: rank 0" in p2.log()
    assert "from rfork-tcp" in p2.log()


def _step_4(flow: Flow[VllmServer]) -> None:
    planner = flow.planner
    before = ids_by_framework(planner, "vllm")
    assert len(before) == 2  # P1 and P2
    p1 = flow.servers["P1"]
    p1.stop()
    deadline = time.monotonic() + 10
    while set(flow.seed_ids["P1"]) & {i["id"] for i in instances(planner)} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not set(flow.seed_ids["P1"]) & {i["id"] for i in instances(planner)}, "P1 did not drain"
    assert "drained seed" in p1.log()  # by the API server: vLLM SIGKILLed the worker
    items = transfers(planner)
    outcomes = sorted((t["outcome"], t["backend"]) for t in items)
    assert outcomes.count(("success", "tcp")) == 3  # seed0 -> A, A -> B, P1 -> P2
    assert sum(1 for o, _ in outcomes if o == "failure") >= 2


def _step_5(flow: Flow[VllmServer]) -> None:
    from tests.vllm.servers import write_bin_copy

    planner = flow.planner
    flow.servers["P2"].kill()  # the last parameters seed dies without draining
    (p2_id,) = ids_by_framework(planner, "vllm")
    p3 = flow.fleet.start_rfork("P3", planner_url=planner.url, mode="parameters")
    bin_model = write_bin_copy(flow.model, flow.workdir / "bin")
    d = flow.fleet.start_rfork("D", planner_url=planner.url, model=bin_model)
    flow.servers.update(P3=p3.wait_ready(), D=d.wait_ready())
    assert p3.generate() == flow.reference
    assert d.generate() == flow.reference
    assert "vLLM's disk loader fills the parameters" in p3.log()
    assert [t["outcome"] for t in transfers(planner) if t["seed_id"] == p2_id] == ["failure"]
    assert "loading with vLLM's default loader: no local safetensors checkpoint" in d.log()
    _record_load_times(flow)


def _record_load_times(flow: Flow[VllmServer]) -> None:
    """rfork's whole-`load_model` figure per rfork server (build, weights, post-processing)."""
    figures: dict[str, float] = {}
    for name, s in flow.servers.items():
        found = re.findall(r"model loaded in ([0-9.]+) s", s.log())
        if found:
            figures[name] = float(found[-1])
    ready = {name: s.ready_s for name, s in flow.servers.items()}
    path = os.environ.get(RESULTS_ENV)
    if path:
        Path(path).write_text(json.dumps({"load_model_s": figures, "ready_s": ready}, indent=1))
    print("rfork load_model seconds:", figures)
    print("seconds to ready:", ready)


_UNDIGESTIBLE_PULL = """
import json, sys, torch
from rfork.pull.result import LoadResult

state_dict = LoadResult.state_dict

def with_an_unknown_tensor(self, rank=0):  # fault injection (test-only): a tensor vLLM has no place for
    return {**state_dict(self, rank), "model.layers.0.mlp.bogus.weight": torch.zeros(2, dtype=torch.bfloat16)}

LoadResult.state_dict = with_an_unknown_tensor
from tests.vllm.bench_load import child
child(sys.argv[1], "rfork", json.loads(sys.argv[2]), False)
"""


def _step_6(flow: Flow[VllmServer]) -> None:
    """`vllm.LLM` in one process pulls from C, then vLLM's `load_weights` rejects the pulled tensors
    (an unknown one is injected): vLLM's disk loader fills the same model, the tokens are the reference."""
    import subprocess
    import sys

    from tests.vllm.bench_load import _CHILD_MARK
    from tests.vllm.servers import cpu_env

    planner = flow.planner
    script = flow.workdir / "undigestible.py"
    script.write_text(_UNDIGESTIBLE_PULL)
    extra = {"planner_url": planner.url, "mode": "checkpoint", "serve": False, "transfer_timeout_s": 3}
    before = {t["id"] for t in transfers(planner)}
    out = subprocess.run(
        [sys.executable, str(script), str(flow.model), json.dumps(extra)],
        capture_output=True, text=True, timeout=900, env=cpu_env(), check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    (row,) = [json.loads(line[len(_CHILD_MARK):]) for line in out.stdout.splitlines()
              if line.startswith(_CHILD_MARK)]
    assert row["tokens"] == flow.reference
    assert "loading with vLLM's default loader: vLLM's load_weights failed on the pulled" in out.stderr
    pulled = [t for t in transfers(planner) if t["id"] not in before]
    # the pull itself went fine: one success. Before it the planner may still offer A and B, which
    # step 3 SIGKILLed (the long TTL keeps them READY, and their quarantine may have run out on a
    # slow machine): those attempts fail on the transport, nothing else may
    assert [t["outcome"] for t in pulled].count("success") == 1, pulled
    assert all(t["reason"] == "transport" for t in pulled if t["outcome"] == "failure"), pulled


STEPS = [_step_1, _step_2, _step_3, _step_4, _step_5, _step_6]


def test_1_pull_from_an_rfork_seed_and_tokens_equal_auto(flow):
    flow.run_through(STEPS, 1)


def test_2_chain_from_the_vllm_seed_and_parameters_mode_without_a_seed(flow):
    flow.run_through(STEPS, 2)


def test_3_parameters_pull_and_failover_past_sigkilled_seeds(flow):
    flow.run_through(STEPS, 3)


def test_4_sigterm_drains_and_transfers_tell_the_story(flow):
    flow.run_through(STEPS, 4)


def test_5_parameters_failover_to_disk_and_vllms_own_loader(flow):
    flow.run_through(STEPS, 5)


def test_6_tensors_vllm_cannot_digest_end_in_its_default_loader(flow):
    flow.run_through(STEPS, 6)
