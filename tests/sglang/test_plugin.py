"""In process, against the installed SGLang: the entry point, the load-format choice, loader dispatch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def plugins_loaded() -> None:
    """SGLang's own plugin loading (entry points, then HookRegistry.apply_hooks), as every process does."""
    from sglang.srt.plugins import load_plugins

    load_plugins()


def test_entry_point_is_declared_in_sglangs_group():
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("rfork") == "rfork.integrations.sglang.plugin:register"


def test_register_is_cheap_it_imports_no_loader_transport_or_planner():
    code = textwrap.dedent(
        """
        import sys, time
        import sglang.srt.arg_groups.choices, sglang.srt.plugins.hook_registry
        before = set(sys.modules)
        t = time.perf_counter()
        from rfork.integrations.sglang.plugin import register
        register()
        took = time.perf_counter() - t
        watched = ('rfork', 'backends', 'planner', 'torch')
        new = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in watched)
        print(took); print(' '.join(new))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    took, new = out.stdout.strip().splitlines()[-2], out.stdout.strip().splitlines()[-1].split()
    allowed = {"rfork", "rfork.integrations", "rfork.integrations.sglang"}
    allowed |= {"rfork.errors"}  # the package's own messages: a module without imports
    allowed |= {"rfork.integrations.sglang.plugin"}
    allowed |= {"rfork.integrations.hook", "rfork.integrations.hook.drain"}  # the drain the plugin arms
    assert set(new) <= allowed, new
    assert float(took) < 0.5


def test_load_format_choice_is_added_and_unknown_formats_still_fail(plugins_loaded):
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES
    from sglang.srt.configs.load_config import LoadConfig, LoadFormat

    assert LOAD_FORMAT_CHOICES.count("rfork") == 1
    assert LoadConfig(load_format="rfork").load_format == "rfork"
    assert LoadConfig(load_format="RFork").load_format == "rfork"
    assert LoadConfig(load_format="auto").load_format is LoadFormat.AUTO
    assert LoadConfig(load_format="dummy").load_format is LoadFormat.DUMMY
    with pytest.raises(ValueError, match="rforks"):
        LoadConfig(load_format="rforks")


def test_cli_accepts_rfork_and_rejects_unknown_formats(plugins_loaded):
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", "/nonexistent", "--load-format", "rfork"])
    assert args.load_format == "rfork"
    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", "/nonexistent", "--load-format", "nope"])


def test_loader_dispatch_routes_only_rfork(plugins_loaded):
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader, DummyModelLoader, get_model_loader

    from rfork.integrations.hook.settings import SettingsError
    from rfork.integrations.sglang.model_loader import RforkModelLoader

    extra = {"planner_url": "http://127.0.0.1:9", "mode": "parameters", "num_threads": 2}
    loader = get_model_loader(LoadConfig(load_format="rfork", model_loader_extra_config=extra))
    assert isinstance(loader, RforkModelLoader)
    assert loader.settings.mode == "parameters"
    assert loader.settings.planner_url == "http://127.0.0.1:9"
    # its fallback is SGLang's own loader, handed only the keys that loader accepts
    default = loader._default_loader()
    assert type(default) is DefaultModelLoader
    assert default.load_config.model_loader_extra_config == {"num_threads": 2}
    assert type(get_model_loader(LoadConfig(load_format="auto"))) is DefaultModelLoader
    assert type(get_model_loader(LoadConfig(load_format="dummy"))) is DummyModelLoader
    with pytest.raises(SettingsError, match="RFORK_TOKEN"):
        get_model_loader(LoadConfig(load_format="rfork", model_loader_extra_config={"token": "t"}))
