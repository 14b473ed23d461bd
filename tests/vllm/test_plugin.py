"""In process, against the installed vLLM: the entry point, the `rfork` load format, settings errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

pytestmark = pytest.mark.vllm


def test_entry_point_is_declared_in_vllms_group():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("rfork") == "rfork.integrations.vllm.plugin:register"


def test_vllms_plugin_loading_registers_rfork_once_and_cheaply():
    """vLLM's own `load_general_plugins` (what every vLLM process runs), twice; only vLLM's loader
    registry and rfork's settings may load: no rfork transport, planner, seed or pull module."""
    code = textwrap.dedent(
        """
        import sys, time
        import vllm.model_executor.model_loader as ml
        from vllm.plugins import load_general_plugins
        before = set(sys.modules)
        t = time.perf_counter()
        load_general_plugins()
        load_general_plugins()
        from rfork.integrations.vllm.plugin import register
        register()
        took = time.perf_counter() - t
        from vllm.config.load import LoadConfig
        loader = ml.get_model_loader(LoadConfig(load_format="RFork"))
        own = ('rfork', 'backends', 'planner')
        new = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in own)
        print(took); print(type(loader).__module__ + '.' + type(loader).__name__); print(' '.join(new))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    took, loader, new = out.stdout.strip().splitlines()[-3:]
    assert loader == "rfork.integrations.vllm.model_loader.RforkModelLoader"
    heavy_roots = ("backends", "planner", "rfork.loader", "rfork.pull", "rfork.seed")
    heavy = [m for m in new.split() if m.startswith(heavy_roots)]
    assert heavy == [], new
    assert float(took) < 2.0, took


def test_auto_and_dummy_formats_stay_vllms():
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import DefaultModelLoader, DummyModelLoader, get_model_loader

    from rfork.integrations.vllm.plugin import register

    register()
    assert type(get_model_loader(LoadConfig(load_format="auto"))) is DefaultModelLoader
    assert type(get_model_loader(LoadConfig(load_format="dummy"))) is DummyModelLoader
    with pytest.raises(ValueError, match="not supported"):
        get_model_loader(LoadConfig(load_format="nonesuch"))


@pytest.mark.parametrize(
    ("extra", "needle"),
    [({"token": "t"}, "RFORK_TOKEN"), ({"mode": "weights"}, "mode"), ({"planer_url": "x"}, "unknown")],
)
def test_bad_extra_config_is_refused_with_the_key(extra, needle):
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from rfork.integrations.hook.settings import SettingsError
    from rfork.integrations.vllm.plugin import register

    register()
    with pytest.raises(SettingsError, match=needle):
        get_model_loader(LoadConfig(load_format="rfork", model_loader_extra_config=extra))


def test_parameters_mode_does_not_serve_parameters_the_post_load_steps_changed_in_place(caplog, monkeypatch):
    """The seed's digests are taken before vLLM's post-load steps; if a step rewrote a parameter in
    place, serving it would hand out post-processed bytes as loaded ones: the seed is not published."""
    import logging

    import torch
    from vllm.config.load import LoadConfig

    from rfork.identity import SourceIdentity
    from rfork.integrations.hook.outcome import LoadOutcome
    from rfork.integrations.vllm.model_loader import RforkModelLoader
    from rfork.weights.rank_weights import RankWeights

    extra = {"planner_url": "http://127.0.0.1:9", "mode": "parameters"}
    loader = RforkModelLoader(LoadConfig(load_format="rfork", model_loader_extra_config=extra))
    weight = torch.ones(8, 8, dtype=torch.bfloat16)
    served = RankWeights.from_tensors(rank=0, tensors={"layer.weight": weight})
    served.compute_checksums()
    ident = SourceIdentity(model="m", revision="main", fingerprint="f", dtype="bfloat16", framework="vllm")
    loader.outcome = LoadOutcome(source="disk", identity=ident, served=served)
    weight.mul_(2)  # what an in-place post-load step would do
    monkeypatch.setattr(logging.getLogger("rfork"), "propagate", True)  # the plugin's handler stops it
    with caplog.at_level(logging.WARNING, logger="rfork"):
        assert loader.become_seed() is None
    assert "changed the loaded parameters in place" in caplog.text
