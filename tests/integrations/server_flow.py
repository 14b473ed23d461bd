"""The steps tests/sglang/test_servers.py and tests/vllm/test_servers.py share, with their fixtures.

Both files run one flow against real servers: numbered steps, each needing the state the steps
before it left (servers started, seeds killed, transfers recorded). Test n runs the steps through n
(`Flow.run_through`), each step once per module, so the file runs as one flow with no server started
twice, and any test runs alone too (`pytest tests/vllm/test_servers.py::test_3_...`): it runs the
steps before its own first. The steps that do not depend on the framework live here; each file adds
its framework's steps and checks. The fixtures (`planner`, `flow`) are imported by the framework
directories' conftest.py, beside their `server_fleet` and `tiny_model`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Generic

import pytest

from tests.integrations.servers import S

Planner = Any  # a PlannerClient with the server's `url` attached (planner imports stay lazy here)


@pytest.fixture(scope="module")
def planner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Planner]:
    from planner import PlannerServer
    from planner.contract import PlannerClient

    db = tmp_path_factory.mktemp("planner") / "planner.db"
    # a long TTL keeps SIGKILLed seeds READY, so a loader really meets a dead seed
    with (
        PlannerServer(db_url=f"sqlite:///{db}", insecure=True, heartbeat_ttl_s=900) as srv,
        PlannerClient(srv.url) as client,
    ):
        client.url = srv.url  # type: ignore[attr-defined]
        yield client


class Flow(Generic[S]):
    """One module's flow: where it runs (planner, fleet, model, a work directory), what the steps
    hand each other, and which steps have run."""

    reference: list[int]
    servers: dict[str, S]
    seed_ids: dict[str, list[str]]

    def __init__(self, planner: Planner, fleet: Any, model: Path, workdir: Path) -> None:
        self.planner = planner
        self.fleet = fleet
        self.model = model
        self.workdir = workdir
        self.servers = {}
        self.seed_ids = {}
        self._done = 0
        self._failed: int | None = None

    def run_through(self, steps: Sequence[Callable[[Flow[S]], object]], n: int) -> None:
        """Run steps 1..n (`steps[0]` is step 1) that have not run yet in this module, in order. A
        step that failed is not run again: a later test that needs it fails at once, naming it."""
        if self._failed is not None and self._failed <= n:
            pytest.fail(f"step {self._failed}, which this test needs, failed earlier in this module")
        while self._done < n:
            step = self._done + 1
            try:
                steps[step - 1](self)
            except BaseException:
                self._failed = step
                raise
            self._done = step


@pytest.fixture(scope="module")
def flow(
    planner: Planner, server_fleet: Any, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Flow[Any]:
    return Flow(planner, server_fleet, tiny_model, tmp_path_factory.mktemp("flow"))


def instances(planner: Planner, **filters: Any) -> list[dict[str, Any]]:
    return [i.model_dump() for i in planner.list_instances(limit=100, **filters).items]


def ids_by_framework(planner: Planner, framework: str) -> set[str]:
    return {i["id"] for i in instances(planner, status="READY") if i["identity"]["framework"] == framework}


def transfers(planner: Planner) -> list[dict[str, Any]]:
    return [t.model_dump() for t in planner.transfers(limit=100).items]


def pull_from_an_rfork_seed_and_match_auto(flow: Flow[Any]) -> None:
    """Step 1: `--load-format auto` gives the reference tokens; beside it A pulls from an `rfork seed`
    over tcp and generates the same; A became the only checkpoint seed once the rfork seed drained."""
    from rfork.seed.seed import Seed
    from rfork.weights.checkpoint import load_state_dict, read_checkpoint_info
    from rfork.weights.rank_weights import RankWeights

    planner, fleet, tiny_model = flow.planner, flow.fleet, flow.model
    info = read_checkpoint_info(tiny_model)
    seed0 = Seed(
        weights=[RankWeights.from_tensors(rank=0, tensors=load_state_dict(tiny_model))],
        identity=info.identity(tp=1),
        planner_url=planner.url,
    ).start()
    flow.seed_ids["rfork-seed"] = seed0.instance_ids
    try:
        auto = fleet.start_auto("auto")
        a = fleet.start_rfork("A", planner_url=planner.url)
        flow.servers.update(auto=auto.wait_ready(), A=a.wait_ready())
        flow.reference = auto.generate()
        assert len(flow.reference) == 12
        assert a.generate() == flow.reference
        assert "rfork: checkpoint mode" in a.log()
        pulled = [t for t in transfers(planner) if t["outcome"] == "success"]
        assert [t["seed_id"] for t in pulled] == seed0.instance_ids
        assert pulled[0]["backend"] == "tcp"
        flow.seed_ids["A"] = sorted(ids_by_framework(planner, "rfork") - set(seed0.instance_ids))
        assert len(flow.seed_ids["A"]) == 1, instances(planner)
    finally:
        seed0.close()  # DRAINING + deleted: from now on A is the only checkpoint seed
    auto.stop()
    assert set(flow.seed_ids["A"]) == ids_by_framework(planner, "rfork")


def chain_and_parameters_mode_without_a_seed(flow: Flow[Any], *, framework: str, fallback_line: str) -> Any:
    """Step 2: B pulls from A (checkpoint mode, a chain); P1 (parameters mode) finds no parameters
    seed, logs `fallback_line`, and becomes the only `framework` seed. Returns P1."""
    planner, fleet = flow.planner, flow.fleet
    b = fleet.start_rfork("B", planner_url=planner.url)
    p1 = fleet.start_rfork("P1", planner_url=planner.url, mode="parameters")
    flow.servers.update(B=b.wait_ready(), P1=p1.wait_ready())
    assert b.generate() == flow.reference
    assert p1.generate() == flow.reference
    from_a = [t for t in transfers(planner) if t["seed_id"] in flow.seed_ids["A"]]
    assert [t["outcome"] for t in from_a] == ["success"]
    assert fallback_line in p1.log()  # no parameters seed yet
    params_seeds = ids_by_framework(planner, framework)
    assert len(params_seeds) == 1
    flow.seed_ids["P1"] = sorted(params_seeds)
    flow.seed_ids["B"] = sorted(ids_by_framework(planner, "rfork") - set(flow.seed_ids["A"]))
    assert len(flow.seed_ids["B"]) == 1
    return p1


def parameters_pull_and_failover_past_sigkilled_seeds(flow: Flow[Any]) -> tuple[Any, Any]:
    """Step 3: A and B die without draining (still READY); P2 pulls its parameters from P1, C fails
    over across both dead seeds and loads from disk. Returns (P2, C) for the framework's own checks."""
    planner, fleet = flow.planner, flow.fleet
    flow.servers["A"].kill()
    flow.servers["B"].kill()
    ready = ids_by_framework(planner, "rfork")
    assert set(flow.seed_ids["A"] + flow.seed_ids["B"]) <= ready
    p2 = fleet.start_rfork("P2", planner_url=planner.url, mode="parameters")
    c = fleet.start_rfork("C", planner_url=planner.url)
    flow.servers.update(P2=p2.wait_ready(), C=c.wait_ready())
    assert p2.generate() == flow.reference
    assert c.generate() == flow.reference
    from_p1 = [t for t in transfers(planner) if t["seed_id"] in flow.seed_ids["P1"]]
    assert [t["outcome"] for t in from_p1] == ["success"]
    dead = set(flow.seed_ids["A"] + flow.seed_ids["B"])
    failed = [t for t in transfers(planner) if t["seed_id"] in dead and t["outcome"] == "failure"]
    assert {t["seed_id"] for t in failed} == dead, transfers(planner)
    assert "rfork: checkpoint mode" in c.log()
    assert "from disk" in c.log()
    return p2, c
