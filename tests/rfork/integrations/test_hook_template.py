"""The hook template (rfork.integrations.hook.loader_base) with a stand-in framework: a new framework's
loader implements `parallel`, `framework_version`, `model_path` and `arrange_drain`; pulling, the
identity, becoming a seed on the pull's own registrations (each buffer once) and closing what no seed
adopts are the template's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from planner.server import PlannerServer
from rfork import LoadOptions, pull_into
from rfork.integrations.hook.loader_base import Parallel, RforkLoaderBase
from rfork.seed.seed import Seed
from rfork.weights.rank_weights import RankWeights
from tests.rfork.conftest import SMALL, assert_same
from tests.rfork.pull.test_hand_off import assert_registered_once, spy_registrations
from tests.tiny_llama import LlamaForCausalLM


class _FrameworkLoader:
    """Stands for a framework's BaseModelLoader: it keeps the load config."""

    def __init__(self, load_config: Any) -> None:
        self.load_config = load_config


class _Loader(RforkLoaderBase, _FrameworkLoader):
    framework = "toy"
    framework_name = "Toy"
    pulls_after_post_load = True
    drains: list[Seed]

    def parallel(self) -> Parallel:
        return Parallel()

    def framework_version(self) -> str:
        return "1"

    def model_path(self, model_config: Any) -> str:
        return str(model_config.model_path)

    def arrange_drain(self, seed: Seed) -> None:
        self.drains = [seed]


class _LoaderBeforePostLoad(_Loader):
    """A framework whose pull lands before its post-load steps (as vLLM's)."""

    pulls_after_post_load = False


def _hook(planner_url: str, *, after_post_load: bool = True, **settings: Any) -> _Loader:
    extra = {"planner_url": planner_url, "mode": "parameters", "transfer_timeout_s": 3.0, **settings}
    kind = _Loader if after_post_load else _LoaderBeforePostLoad
    return kind(SimpleNamespace(model_loader_extra_config=extra))


MODEL_CONFIG = SimpleNamespace(
    model_path="/models/small", hf_config=None, revision=None, dtype=torch.bfloat16, quantization=None
)


@pytest.fixture
def open_planner(sqlite_url: str) -> Iterator[str]:
    """A planner without auth: a hook acts with one token for pulling and publishing."""
    with PlannerServer(db_url=sqlite_url, insecure=True) as srv:
        yield srv.url


@pytest.fixture
def parameters_seed(open_planner: str) -> Iterator[tuple[dict[str, torch.Tensor], Seed]]:
    """A seed of the small model's parameters under the toy framework's parameters identity."""
    torch.manual_seed(0)
    params: dict[str, torch.Tensor] = dict(LlamaForCausalLM(SMALL).named_parameters())
    ident = _hook(open_planner).parameters_identity(MODEL_CONFIG, params, torch.device("cpu"))
    weights = RankWeights.from_tensors(tensors=params)
    with Seed(weights=[weights], identity=ident, planner_url=open_planner) as seed:
        yield params, seed


@pytest.mark.slow
@pytest.mark.parametrize("after_post_load", [True, False], ids=["sglang-like", "vllm-like"])
def test_the_hook_template_registers_each_pulled_parameter_once(
    open_planner, parameters_seed, monkeypatch, after_post_load
):
    source, seed = parameters_seed
    made = spy_registrations(monkeypatch)
    hook = _hook(open_planner, after_post_load=after_post_load)
    model = LlamaForCausalLM(SMALL)  # built, post-processed, still empty
    params = dict(model.named_parameters())
    ident = hook.parameters_identity(MODEL_CONFIG, params, torch.device("cpu"))
    assert hook.pull_parameters(params, identity=ident, rank=hook.global_rank()) is None
    assert hook.outcome is not None
    assert hook.outcome.source == "rfork-tcp"
    assert_same({n: p.detach() for n, p in params.items()}, {n: p.detach() for n, p in source.items()})
    hook.become_seed_soon(model)  # after the framework's own steps, on a helper thread
    assert hook.seeding is not None
    hook.seeding.join(60)
    became = hook.seed
    try:
        assert became is not None
        assert hook.drains == [became]
        assert_registered_once(made, hook.outcome.served)  # type: ignore[arg-type]
        assert became.instance_ids
        third = pull_into(
            identity=ident,
            planner_url=open_planner,
            tensors={n: torch.empty_like(p) for n, p in source.items()},
            options=LoadOptions(providers=["tcp"], exclude=seed.instance_ids, become_seed=False),
        )
        assert third.attempts[0].instance_id == became.instance_ids[0]  # served on what it adopted
        assert_same(third.state_dict(), {n: p.detach() for n, p in source.items()})
    finally:
        if became is not None:
            became.close()


@pytest.mark.slow
def test_the_hook_template_closes_a_pull_it_cannot_serve(open_planner, parameters_seed):
    hook = _hook(open_planner)
    model = LlamaForCausalLM(SMALL)
    params = dict(model.named_parameters())
    ident = hook.parameters_identity(MODEL_CONFIG, params, torch.device("cpu"))
    assert hook.pull_parameters(params, identity=ident, rank=0) is None
    assert hook.outcome is not None
    pulled = hook.outcome.pulled
    assert pulled is not None
    engine = pulled.engine
    assert engine is not None
    hook.outcome.identity = None  # e.g. a draft model's: nothing this rank may serve
    assert hook.become_seed(model) is None
    assert engine.closed
    assert all(r.closed for r in pulled.ranks[0].regions)


def test_becoming_a_seed_soon_returns_while_the_seed_starts(monkeypatch):
    """The re-check, registrations and publication run beside the framework's start, once."""
    hook = _hook("http://p")
    gate = threading.Event()
    calls: list[Any] = []

    def slow_become_seed(model: Any = None) -> None:
        calls.append(model)
        assert gate.wait(30)

    monkeypatch.setattr(hook, "become_seed", slow_become_seed)
    model = torch.nn.Linear(2, 2)
    hook.become_seed_soon(model)
    hook.become_seed_soon(model)  # a second call starts nothing
    assert hook.seeding is not None
    assert hook.seeding.is_alive()  # returned while becoming a seed still runs
    gate.set()
    hook.seeding.join(30)
    assert not hook.seeding.is_alive()
    assert calls == [model]


def test_settings_hold_the_pull_for_a_seed_only_when_serving():
    assert _hook("http://p").settings.load_options().seed_later
    assert not _hook("http://p", serve=False).settings.load_options().seed_later
    assert not _hook("http://p").settings.load_options().become_seed  # the hook seeds later, by itself


@pytest.mark.slow
def test_a_hook_pulls_with_the_load_token_and_registers_with_the_register_token(planner, monkeypatch, caplog):
    """A pair of tokens, as `rfork load` takes them: $RFORK_TOKEN (load) pulls, $RFORK_REGISTER_TOKEN
    (register) publishes the seed (main: the hook registered with the load token, and the planner
    refused). Without the register token, the warning names the role that is missing."""
    from tests.rfork.conftest import LOAD, REGISTER

    monkeypatch.setenv("RFORK_TOKEN", LOAD)
    monkeypatch.setenv("RFORK_REGISTER_TOKEN", REGISTER)
    torch.manual_seed(0)
    source = dict(LlamaForCausalLM(SMALL).named_parameters())
    ident = _hook(planner).parameters_identity(MODEL_CONFIG, source, torch.device("cpu"))
    weights = RankWeights.from_tensors(tensors=source)
    with Seed(weights=[weights], identity=ident, planner_url=planner, token=REGISTER):
        for register_token in (REGISTER, None):
            if register_token is None:
                monkeypatch.delenv("RFORK_REGISTER_TOKEN")
            hook = _hook(planner)
            assert (hook.settings.token, hook.settings.register_token) == (LOAD, register_token)
            model = LlamaForCausalLM(SMALL)
            params = dict(model.named_parameters())
            assert hook.pull_parameters(params, identity=ident, rank=0) is None
            assert hook.outcome is not None
            assert hook.outcome.source == "rfork-tcp"
            caplog.clear()
            became = hook.become_seed(model)
            if register_token is not None:
                assert became is not None
                became.close()
            else:
                assert became is None
                assert "a seed needs the register role" in caplog.text
                assert "$RFORK_TOKEN (no $RFORK_REGISTER_TOKEN)" in caplog.text


_SCRAPE_A_HOOK = """
import sys, types, urllib.request
import torch
from tests.rfork.integrations.test_hook_template import _hook
hook = _hook("", mode="checkpoint")  # no planner: rfork reads the checkpoint itself
config = types.SimpleNamespace(model_path=sys.argv[1], hf_config=None, revision=None, dtype=torch.bfloat16,
                               quantization=None)
assert hook.pull_checkpoint(config) is None, "rfork did not load it"
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
print(opener.open("http://127.0.0.1:%s/metrics" % sys.argv[2], timeout=10).read().decode())
"""


@pytest.mark.slow
def test_a_hook_serves_rforks_metrics_on_its_port_plus_its_rank(small_ckpt, tmp_path):
    """RFORK_METRICS_PORT in a framework worker (a stand-in framework here; rank 0): rfork's metrics at
    /metrics of that port, scraped over HTTP, count the load and why it was not from a seed."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RFORK_METRICS_PORT": str(port), "RFORK_METRICS_HOST": "127.0.0.1"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    env.pop("RFORK_PLANNER_URL", None)
    out = subprocess.run(
        [sys.executable, "-c", _SCRAPE_A_HOOK, str(small_ckpt), str(port)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert 'rfork_pulls_total{outcome="success",source="disk"} 1.0' in out.stdout, out.stdout
    assert 'rfork_fallbacks_total{reason="no_planner"} 1.0' in out.stdout, out.stdout


def test_the_per_rank_line_puts_the_bytes_moved_beside_the_ranks_shard():
    """With TP>1 a checkpoint-mode rank pulls the whole checkpoint for its share of it: the hooks' per-rank
    log line says both, so the 2x of a TP=2 rank shows (and the 1x of a parameters-mode pull)."""
    from rfork.integrations.hook.outcome import LoadOutcome

    hook = _hook("http://127.0.0.1:9")
    hook.record(LoadOutcome(source="rfork-tcp", bytes=2000))
    hook.note_shard({"a": torch.zeros(250, dtype=torch.bfloat16), "b": torch.zeros(125, dtype=torch.float32)})
    assert hook.outcome is not None
    assert hook.outcome.moved(1) == "rank 1, 2000 bytes from rfork-tcp for a 1000-byte shard (2.00x)"


class _SlicingLoader(_Loader):
    """A framework at TP=2, worker rank 1, that shards checkpoints as backends.sharding does."""

    def parallel(self) -> Parallel:
        return Parallel(tp=2, tp_rank=1)

    def checkpoint_slice(self, model_config: Any) -> tuple[int, int] | None:
        return 2, 1


def test_a_checkpoint_mode_rank_pulls_its_slice_hands_on_full_shapes_and_serves_its_layout(
    open_planner: str, small_ckpt
) -> None:
    from backends import shard_tensor
    from planner.contract import PlannerClient
    from rfork.integrations.hook.pulling import checkpoint_tensors
    from rfork.weights.checkpoint import load_rank_from_disk, load_state_dict, read_checkpoint_info

    info = read_checkpoint_info(small_ckpt)
    layout, buffers, tensors = load_rank_from_disk(info)
    whole = RankWeights(rank=0, layout=layout, buffers=buffers, tensors=tensors)
    config = SimpleNamespace(model_path=small_ckpt, hf_config=None, revision=None, dtype=torch.bfloat16)
    extra = {"planner_url": open_planner, "mode": "checkpoint", "transfer_timeout_s": 3.0}
    hook = _SlicingLoader(SimpleNamespace(model_loader_extra_config=extra))
    with Seed(weights=[whole], identity=info.identity(), planner_url=open_planner):  # TP=1, with stripes
        assert hook.pull_checkpoint(config) is None
    out = hook.outcome
    assert out is not None
    assert out.identity is not None
    assert (out.source, out.rank, out.identity.tp) == ("rfork-tcp", 1, 2)
    assert out.bytes == load_rank_from_disk(info, tp=2, rank=1)[0].total_bytes  # its slice, not all
    assert hook.checkpoint is not None
    assert out.pulled is not None
    full = dict(checkpoint_tensors(out.pulled.state_dict(1), *hook.checkpoint))
    disk = load_state_dict(small_ckpt)
    for name, t in full.items():  # what the framework's loader keeps of each: rank 1's slice, as from disk
        assert t.shape == disk[name].shape, name
        assert torch.equal(shard_tensor(name, t, 2, 1), shard_tensor(name, disk[name], 2, 1)), name
    seed = hook.become_seed()  # a seed of the TP=2 checkpoint layout's rank 1
    assert seed is not None
    try:
        with PlannerClient(open_planner) as client:
            (instance,) = [i for i in client.list_instances().items if i.id in seed.instance_ids]
        assert (instance.identity["tp"], instance.identity["framework"]) == (2, "rfork")
        assert [r.rank for r in instance.ranks] == [1]
    finally:
        seed.close()
