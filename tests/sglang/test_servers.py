"""Real SGLang servers on CPU loading a tiny Llama with `rfork sglang` (one flow, servers shared).

Steps (each needs the ones before; servers start in pairs where independent, to save time; test n
runs the steps through n that have not run yet, so it runs alone too: tests/integrations/server_flow.py):
  1. `--load-format auto` (the reference tokens) beside A, which pulls from an `rfork seed` over tcp;
  2. A became a seed: the rfork seed drains, and B pulls from A (checkpoint mode, chain);
     beside it P1 in parameters mode finds no parameters seed and loads with SGLang's own loader;
  3. P2 pulls straight into its parameters from P1; beside it, after A and B were SIGKILLed (still
     READY in the planner), C fails over across both dead seeds and loads from disk;
  4. SIGTERM drains the servers; `/v1/transfers` shows every pull, failures included.
Every server's generated tokens equal the `auto` server's for the same prompt.
"""

from __future__ import annotations

import json
import os
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
from tests.sglang.servers import SglangServer

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(1500)]

RESULTS_ENV = "RFORK_SGLANG_RESULTS"  # optional: write the measured load times here as JSON


def _step_1(flow: Flow[SglangServer]) -> None:
    pull_from_an_rfork_seed_and_match_auto(flow)


def _step_2(flow: Flow[SglangServer]) -> None:
    chain_and_parameters_mode_without_a_seed(
        flow, framework="sglang", fallback_line="loading with SGLang's default loader"
    )


def _step_3(flow: Flow[SglangServer]) -> None:
    p2, _ = parameters_pull_and_failover_past_sigkilled_seeds(flow)
    assert "rfork: parameters mode" in p2.log()


def _step_4(flow: Flow[SglangServer]) -> None:
    planner = flow.planner
    before = ids_by_framework(planner, "sglang")
    assert len(before) == 2  # P1 and P2
    p1 = flow.servers["P1"]
    p1.stop()
    left = {i["id"] for i in instances(planner)}
    assert not set(flow.seed_ids["P1"]) & left, "P1 did not drain on SIGTERM"
    items = transfers(planner)
    outcomes = sorted((t["outcome"], t["backend"]) for t in items)
    assert outcomes.count(("success", "tcp")) == 3  # seed0 -> A, A -> B, P1 -> P2
    assert sum(1 for o, _ in outcomes if o == "failure") >= 2
    _record_load_times(flow)


def _record_load_times(flow: Flow[SglangServer]) -> None:
    """SGLang's own `Load weight end` figure per server (whole ModelRunner.load_model)."""
    figures = {name: s.weight_load_seconds() for name, s in flow.servers.items()}
    ready = {name: s.ready_s for name, s in flow.servers.items()}
    path = os.environ.get(RESULTS_ENV)
    if path:
        Path(path).write_text(json.dumps({"weight_load_s": figures, "ready_s": ready}, indent=1))
    print("SGLang weight load seconds:", figures)
    print("seconds to ready:", ready)


STEPS = [_step_1, _step_2, _step_3, _step_4]


def test_1_pull_from_an_rfork_seed_and_tokens_equal_auto(flow):
    flow.run_through(STEPS, 1)


def test_2_chain_from_the_sglang_seed_and_parameters_mode_without_a_seed(flow):
    flow.run_through(STEPS, 2)


def test_3_parameters_pull_and_failover_past_sigkilled_seeds(flow):
    flow.run_through(STEPS, 3)


def test_4_sigterm_drains_and_transfers_tell_the_story(flow):
    flow.run_through(STEPS, 4)
