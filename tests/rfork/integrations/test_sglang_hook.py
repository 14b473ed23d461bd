"""The parts of the SGLang hook that need no SGLang: settings, the launcher, in-place serving, draining.

The real SGLang tests are in tests/sglang (they run in .venv-sglang, see scripts/dev.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rfork import LoadOptions, load
from rfork.cli import sglang as launcher
from rfork.integrations.hook import drain
from rfork.integrations.hook.identity import parameters_fingerprint, parameters_identity
from rfork.integrations.hook.serving import start_seed
from rfork.integrations.hook.settings import HookSettings, SettingsError, default_loader_extra
from rfork.weights.rank_weights import RankWeights
from tests.rfork.conftest import ADMIN, AUTH, REGISTER, SMALL
from tests.tiny_llama import LlamaForCausalLM

# ------------------------------------------------------------------------------------ settings


def test_settings_extra_config_wins_over_env_and_token_comes_only_from_env():
    env = {
        "RFORK_PLANNER_URL": "http://env:1/",
        "RFORK_MODE": "parameters",
        "RFORK_PROVIDERS": "shm, tcp",
        "RFORK_TOKEN": "s3cret",
        "RFORK_SERVE": "0",
    }
    s = HookSettings.resolve({"planner_url": "http://extra:2/", "providers": ["efa"]}, env)
    assert s.planner_url == "http://extra:2"
    assert s.providers == ("efa",)
    assert s.mode == "parameters"
    assert s.serve is False
    assert s.token == "s3cret"
    assert "token" not in s.to_extra_config()
    assert HookSettings.resolve(None, {}) == HookSettings()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"token": "x"}, "RFORK_TOKEN"),
        ({"planner": "http://x"}, "unknown"),
        ({"mode": "weights"}, "mode"),
        ({"providers": []}, "providers"),
        ({"providers": 3}, "providers"),
        ({"serve": "maybe"}, "serve"),
        ({"transfer_timeout_s": "soon"}, "transfer_timeout_s"),
        ({"transfer_timeout_s": 0}, "transfer_timeout_s"),
    ],
)
def test_settings_bad_input_names_the_key(extra, needle):
    with pytest.raises(SettingsError, match=needle):
        HookSettings.resolve(extra, {})


def test_default_loader_keys_pass_through_to_sglangs_loader():
    extra = {"planner_url": "http://p", "enable_multithread_load": True, "num_threads": 4}
    assert HookSettings.resolve(extra, {}).planner_url == "http://p"
    assert default_loader_extra(extra) == {"enable_multithread_load": True, "num_threads": 4}


@given(
    planner=st.one_of(st.none(), st.from_regex(r"http://[a-z]{1,8}:[1-9][0-9]{0,3}", fullmatch=True)),
    mode=st.sampled_from(["checkpoint", "parameters"]),
    providers=st.lists(st.sampled_from(["tcp", "shm", "efa", "verbs", "nccl"]), min_size=1, max_size=3),
    serve=st.booleans(),
    model=st.one_of(st.none(), st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1)),
    timeout=st.floats(min_value=0.01, max_value=1e4),
)
def test_settings_round_trip_through_the_extra_config(planner, mode, providers, serve, model, timeout):
    s = HookSettings(
        planner_url=planner,
        mode=mode,
        providers=tuple(providers),
        serve=serve,
        model=model,
        transfer_timeout_s=timeout,
    )
    extra = json.loads(json.dumps(s.to_extra_config()))
    assert HookSettings.resolve(extra, {}) == s


# ------------------------------------------------------------------------------------ launcher


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launcher.configure(parser)
    return parser.parse_args(argv)


def test_launcher_runs_sglangs_server_module_with_the_arguments_in_order():
    """The extra config's merging is checked for both launchers in test_hook_launch.py."""
    extra = ["--model-loader-extra-config", '{"num_threads": 2}']
    args = _args(["--", "--model-path", "/m", *extra, "--port", "1"])
    argv, _ = launcher.build_command(args, args.sglang_args, {})
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert argv[3:7] == ["--model-path", "/m", "--port", "1"]
    assert argv[7:9] == ["--load-format", "rfork"]


def test_launcher_keeps_a_full_command():
    args = _args(["--", "sglang", "serve", "--model-path", "/m"])
    argv, _ = launcher.build_command(args, args.sglang_args, {})
    assert argv[:4] == ["sglang", "serve", "--model-path", "/m"]


@pytest.mark.parametrize(
    ("sglang_args", "needle"),
    [
        (["--weight-cache-mode", "daemon"], "weight-cache-mode"),
        (["--weight-cache-mode=client"], "weight-cache-mode"),
        (["--startup-weight-load-mode", "overlap"], "overlap"),
        (["--load-format", "auto"], "conflicts"),
        (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/d"], "draft"),
        (["--speculative-draft-model=/d", "--speculative-draft-load-format", "rfork"], "draft"),
        ([], "no SGLang arguments"),
    ],
)
def test_launcher_refuses_what_bypasses_or_breaks_the_hook(sglang_args, needle):
    args = _args(["--", *sglang_args] if sglang_args else [])
    with pytest.raises(ValueError, match=needle):
        launcher.build_command(args, args.sglang_args, {})


def test_launcher_accepts_a_draft_with_a_plan_and_serial_loading():
    args = _args(
        [
            "--",
            "--model-path",
            "/m",
            "--speculative-algorithm",
            "EAGLE",
            "--speculative-draft-model-path",
            "/d",
            "--speculative-draft-load-format",
            "auto",
            "--startup-weight-load-mode",
            "serial",
            "--weight-cache-mode",
            "off",
        ]
    )
    argv, _ = launcher.build_command(args, args.sglang_args, {})
    assert argv[argv.index("--speculative-draft-load-format") + 1] == "auto"


def test_cli_dry_run_prints_the_command_and_bad_input_is_one_line(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "rfork", "sglang", "--dry-run", "--", "--model-path", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert "--load-format rfork" in ok.stdout
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "rfork",
            "sglang",
            "--",
            "--model-path",
            "/m",
            "--weight-cache-mode",
            "daemon",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2  # a wrong setting
    assert bad.stderr.strip().count("\n") == 0
    assert "weight-cache-mode" in bad.stderr


# ------------------------------------------------------------------------------------ serving in place


def test_parameters_identity_tracks_shapes_and_layout():
    a = {"w": torch.zeros(4, 8, dtype=torch.bfloat16), "b": torch.zeros(8)}
    b = {"w": torch.zeros(8, 4, dtype=torch.bfloat16), "b": torch.zeros(8)}
    assert parameters_fingerprint(a) != parameters_fingerprint(b)

    def ident(tp: int):
        return parameters_identity(
            framework="sglang",
            model="m",
            revision="r",
            tensors=a,
            dtype=torch.bfloat16,
            quantization=None,
            tp=tp,
            pp=1,
            ep=1,
            dp=1,
            framework_version="0.5.23",
            device="cpu",
        )

    one, two = ident(1), ident(2)
    assert one.framework == "sglang"
    assert one.quantization == "none"
    assert one.device_kind == "cpu"
    assert one.key() != two.key()


@pytest.mark.slow
def test_parameters_served_in_place_are_pulled_bit_identical_then_drained(tmp_path, planner, monkeypatch):
    from planner.contract import PlannerClient

    monkeypatch.setenv(drain.RUN_DIR_ENV, str(tmp_path / "run"))
    model = LlamaForCausalLM(SMALL)
    params = dict(model.named_parameters())
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    weights = RankWeights.from_tensors(rank=0, tensors=params)  # served where they live, no copy
    ident = parameters_identity(
        framework="sglang",
        model="small",
        revision="main",
        tensors=params,
        dtype=torch.bfloat16,
        quantization=None,
        tp=1,
        pp=1,
        ep=1,
        dp=1,
        framework_version="test",
        device="cpu",
    )
    settings = HookSettings(planner_url=planner, token=REGISTER, providers=("tcp",), transfer_timeout_s=3.0)
    seed = start_seed(weights=[weights], identity=ident, settings=settings)  # as the SGLang hook does
    drain.record_publications(seed, planner_url=planner)
    try:
        records = list((tmp_path / "run").glob("*.json"))
        assert [r.stem for r in records] == seed.instance_ids
        assert oct(records[0].stat().st_mode & 0o777) == "0o600"
        result = load(
            identity=ident,
            planner_url=planner,
            **AUTH,
            options=LoadOptions(providers=["tcp"], become_seed=False, transfer_timeout_s=3.0),
        )
        try:
            assert result.source == "rfork-tcp"
            for name, p in params.items():
                assert torch.equal(result.state_dict()[name], p), name
            assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs  # module untouched
        finally:
            result.close()
        with PlannerClient(planner, token=ADMIN) as client:
            assert client.list_instances(status="READY").total == 1
            assert drain.drain_recorded() == 1
            assert client.list_instances().total == 0
        assert not (tmp_path / "run").exists()
    finally:
        seed.close()


def test_only_a_root_process_arms_the_drain(tmp_path):
    code = (
        "import multiprocessing as mp, os\n"
        "from rfork.integrations.hook import drain\n"
        "def child(q):\n"
        "    q.put((drain.arm_drain_in_main_process(), os.environ.get(drain.RUN_DIR_ENV)))\n"
        "if __name__ == '__main__':\n"
        "    armed = drain.arm_drain_in_main_process()\n"
        "    q = mp.get_context('spawn').Queue()\n"
        "    p = mp.get_context('spawn').Process(target=child, args=(q,)); p.start()\n"
        "    c_armed, c_dir = q.get(timeout=60); p.join(60)\n"
        "    print(armed, c_armed, c_dir == os.environ[drain.RUN_DIR_ENV])\n"
    )
    script = tmp_path / "arm.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    env.pop(drain.RUN_DIR_ENV, None)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "True"]
