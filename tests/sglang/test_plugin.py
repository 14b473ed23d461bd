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


_TWO_SIGQUITS = """
import importlib.abc, json, logging, os, signal, socket, sys, threading
logging.basicConfig(level=logging.INFO)
from sglang.srt.plugins import load_plugins
load_plugins()  # the root process: the plugin arms the drain
import sglang.srt.entrypoints.engine as engine
try:
    engine._set_envs_and_config(None)  # rfork's hook runs first; SGLang's own body then fails on None
except Exception:
    pass
from rfork.integrations.hook import drain
from rfork.integrations.sglang import plugin


def second_sigquit():  # a second child failing: another SIGQUIT while the first one's drain runs
    os.kill(os.getpid(), signal.SIGQUIT)


class SignalMidImport(importlib.abc.MetaPathFinder):
    fired = False

    def find_spec(self, name, path, target=None):  # planner.contract.client runs, half-initialised
        if name == "planner.contract.protocol" and not self.fired:
            self.fired = True
            second_sigquit()
        return None


sys.meta_path.insert(0, SignalMidImport())
planner = socket.create_server(("127.0.0.1", 0))
def planner_that_signals():  # the drain's request arrives: signal, then close without an answer
    conn, _ = planner.accept()
    second_sigquit()
    conn.close()
    while True:
        planner.accept()[0].close()
threading.Thread(target=planner_that_signals, daemon=True).start()
url = "http://127.0.0.1:%d" % planner.getsockname()[1]
drain.record_publication(instance_id="a" * 32, token=None, planner_url=url)
entries = []
def sglang_sigquit_handler(signum, frame):  # what SGLang's handler runs first: rfork's BEFORE hook
    entries.append(signum)
    plugin.before_kill_process_tree()
signal.signal(signal.SIGQUIT, sglang_sigquit_handler)
os.kill(os.getpid(), signal.SIGQUIT)
print("entries", len(entries), "left", os.path.isdir(os.environ[drain.RUN_DIR_ENV]))
"""


def test_the_drain_survives_a_second_sigquit_while_it_runs():
    """Two children failing send SGLang's main process two SIGQUITs: the second enters the drain while
    the first is still in it (importing the planner client, or waiting on the planner). The imports
    were done before SGLang installed its handler, the drain is re-entrant: no ImportError, both
    entries end, the record is gone (main: ImportError on a half-initialised planner.contract)."""
    out = subprocess.run(
        [sys.executable, "-c", _TWO_SIGQUITS], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "entries 2 left False", out.stdout
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
