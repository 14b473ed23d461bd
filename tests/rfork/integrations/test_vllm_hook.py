"""The parts of the vLLM hook that need no vLLM: the launcher, the identity, draining at process exit.

The real vLLM tests are in tests/vllm (they run in .venv-vllm, see scripts/dev.sh).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rfork.cli import vllm as launcher
from rfork.integrations.hook.drain import RUN_DIR_ENV
from rfork.integrations.hook.identity import parameters_identity
from tests.rfork.conftest import ADMIN, REGISTER
from tests.waiting import wait_until


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launcher.configure(parser)
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------ launcher


def test_launcher_runs_vllms_api_server_with_the_model_as_a_flag():
    """The extra config's merging is checked for both launchers in test_hook_launch.py."""
    args = _args(["--", "/models/m", "--port", "1", "--model-loader-extra-config", '{"num_threads": 2}'])
    argv, _ = launcher.build_command(args, args.vllm_args, {})
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[3:7] == ["--model", "/models/m", "--port", "1"]
    assert argv[7:9] == ["--load-format", "rfork"]


def test_launcher_tells_the_lora_resolver_in_the_api_server_where_the_planner_is():
    args = _args(["--planner", "http://p:8470/", "--provider", "shm,tcp", "--model-name", "m", "--", "/m"])
    _, env = launcher.build_command(args, args.vllm_args, {"RFORK_TOKEN": "t"})
    assert env["RFORK_PLANNER_URL"] == "http://p:8470"
    assert env["RFORK_PROVIDERS"] == "shm,tcp"
    assert env["RFORK_MODEL_NAME"] == "m"
    assert float(env["RFORK_TRANSFER_TIMEOUT_S"]) > 0


def test_launcher_keeps_a_full_vllm_serve_command():
    args = _args(["--", "vllm", "serve", "/m", "--load-format=rfork"])
    argv, env = launcher.build_command(args, args.vllm_args, {})
    assert argv[:3] == ["vllm", "serve", "/m"]
    assert argv.count("--load-format") == 1
    assert "--load-format=rfork" not in argv
    assert "VLLM_PLUGINS" not in env


@pytest.mark.parametrize(
    ("vllm_args", "needle"),
    [
        (["/m", "--load-format", "safetensors"], "conflicts"),
        (["/m", "--load-format=ipc_cache"], "conflicts"),
        (["/m", "--speculative-config", '{"model": "/draft", "num_speculative_tokens": 2}'], "draft"),
        (["/m", "--config", "serve.yaml"], "--config"),
        (["vllm", "bench", "/m"], "only `vllm serve`"),
        ([], "no vLLM arguments"),
    ],
)
def test_launcher_refuses_what_bypasses_or_breaks_the_hook(vllm_args, needle):
    args = _args(["--", *vllm_args] if vllm_args else [])
    with pytest.raises(ValueError, match=needle):
        launcher.build_command(args, args.vllm_args, {})


def test_launcher_accepts_speculation_without_a_draft_model():
    args = _args(["--", "/m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    argv, _ = launcher.build_command(args, args.vllm_args, {})
    assert "--speculative-config" in argv


def test_cli_dry_run_prints_the_command_and_bad_input_is_one_line(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "rfork", "vllm", "--dry-run", "--", str(tmp_path), "--port", "8000"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert "--load-format rfork" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "rfork", "vllm", "--", "/m", "--load-format", "dummy"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert bad.returncode == 2  # a wrong setting
    assert bad.stderr.strip().count("\n") == 0
    assert "--load-format dummy" in bad.stderr


# ------------------------------------------------------------------------------------ identity


def test_a_vllm_parameters_identity_never_equals_an_sglang_one():
    tensors = {"w": torch.zeros(4, 8, dtype=torch.bfloat16)}
    common: dict[str, Any] = {
        "model": "m", "revision": "main", "tensors": tensors, "dtype": torch.bfloat16, "quantization": None,
        "tp": 1, "pp": 1, "ep": 1, "dp": 1, "framework_version": "0.32.0", "device": "cpu",
    }
    ours = parameters_identity(framework="vllm", **common)
    assert (ours.framework, ours.framework_version, ours.quantization) == ("vllm", "0.32.0", "none")
    assert ours.key() != parameters_identity(framework="sglang", **common).key()
    assert ours.key() != parameters_identity(framework="vllm", **{**common, "tp": 2}).key()
    assert ours.key() != parameters_identity(framework="vllm", **{**common, "quantization": "fp8"}).key()
    bigger = {"w": torch.zeros(8, 8, dtype=torch.bfloat16)}
    assert ours.key() != parameters_identity(framework="vllm", **{**common, "tensors": bigger}).key()


# ------------------------------------------------------------------------------------ draining

_CHILD = """
import multiprocessing as mp, os, signal, sys, time, torch

def engine(planner, ready):
    # like vLLM's engine core: a spawned child whose SIGTERM handler raises SystemExit
    def stop(*_):
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, stop)
    from rfork.identity import SourceIdentity
    from rfork.integrations.vllm.lifecycle import drain_at_exit
    from rfork.seed.seed import Seed
    from rfork.weights.rank_weights import RankWeights
    w = RankWeights.from_tensors(rank=0, tensors={"w": torch.arange(64, dtype=torch.float32)})
    ident = SourceIdentity(model="m", revision="main", fingerprint="f", dtype="float32", framework="vllm")
    seed = Seed(weights=[w], identity=ident, planner_url=planner, token=sys.argv[2], providers=["tcp"])
    seed.start()
    drain_at_exit(seed, planner_url=planner)
    ready.set()
    while True:
        time.sleep(0.1)

if __name__ == "__main__":
    from rfork.integrations.hook.drain import arm_drain_in_main_process
    assert arm_drain_in_main_process()  # as the plugin does in vLLM's API server
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=engine, args=(sys.argv[1], ready))
    p.start()
    assert ready.wait(120)
    print(p.pid, flush=True)
    p.join(120)
    print(p.exitcode, flush=True)
    sys.stdin.read()  # then exit: atexit drains what the child left recorded
"""


@pytest.mark.slow
def test_a_spawned_engine_process_drains_its_seed_on_sigterm(tmp_path: Path, planner: str):
    """vLLM's engine core is a multiprocessing child (atexit does not run there): SIGTERM drains."""
    from planner.contract import PlannerClient

    script = tmp_path / "engine.py"
    script.write_text(_CHILD)
    env = {**os.environ, "PYTHONPATH": str(Path.cwd()), "RFORK_TCP_HOST": "127.0.0.1"}
    proc = _start_engine_like(script, planner, env)
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        child = int(proc.stdout.readline())
        with PlannerClient(planner, token=ADMIN) as client:
            assert client.list_instances(status="READY").total == 1
            os.kill(child, signal.SIGTERM)
            assert int(proc.stdout.readline()) == 0
            _wait_until_empty(client)
            proc.stdin.close()
            assert proc.wait(30) == 0, "the root process failed to drain a drained seed quietly"
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.slow
def test_the_root_process_drains_the_seed_of_a_sigkilled_worker(tmp_path: Path, planner: str):
    """vLLM SIGKILLs its engine core and worker on shutdown: the API server drains their records."""
    from planner.contract import PlannerClient

    script = tmp_path / "engine.py"
    script.write_text(_CHILD)
    env = {**os.environ, "PYTHONPATH": str(Path.cwd()), "RFORK_TCP_HOST": "127.0.0.1"}
    env.pop(RUN_DIR_ENV, None)
    proc = _start_engine_like(script, planner, env)
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        child = int(proc.stdout.readline())
        with PlannerClient(planner, token=ADMIN) as client:
            os.kill(child, signal.SIGKILL)
            assert int(proc.stdout.readline()) == -signal.SIGKILL
            assert client.list_instances(status="READY").total == 1  # dead, still READY
            proc.stdin.close()
            assert proc.wait(30) == 0
            assert client.list_instances().total == 0, "the root process did not drain"
    finally:
        proc.kill()
        proc.wait(30)


def _start_engine_like(script: Path, planner: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(script), planner, REGISTER],
        stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True, env=env,
    )


def _wait_until_empty(client: Any, timeout_s: float = 10.0) -> None:
    wait_until(lambda: client.list_instances().total == 0, timeout_s, "the seed drained", every_s=0.2)
