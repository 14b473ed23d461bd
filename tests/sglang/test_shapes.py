"""The shapes users run, through `rfork sglang` on real SGLang servers on CPU: an MoE model (a tiny
Mixtral) seed -> A -> B in checkpoint mode and P1 -> P2 in parameters mode, every server's greedy
tokens equal to SGLang's own disk load (tests/integrations/shapes.py). What SGLang's CPU path refuses
(TP=2, compressed-tensors checkpoints) is in docs/shapes.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations.server_flow import Planner
from tests.integrations.shapes import seed_a_b_in_both_modes, to_mixtral
from tests.sglang.servers import ServerFleet
from tests.sglang.tiny_model import write_tiny_llama

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_moe_seed_to_a_to_b_in_both_modes_with_sglangs_tokens(planner: Planner, tmp_path: Path) -> None:
    model = to_mixtral(write_tiny_llama(tmp_path / "model"))
    (tmp_path / "servers").mkdir()
    fleet = ServerFleet(tmp_path / "servers", model)
    try:
        facts = seed_a_b_in_both_modes(planner, fleet, model, tp=1)
    finally:
        fleet.close()
    # TP=1: every pull is the whole model, in the checkpoint's layout or SGLang's fused one
    assert all(0.95 <= f.ratio <= 1.05 for f in facts["A"] + facts["B"] + facts["P2"]), facts
