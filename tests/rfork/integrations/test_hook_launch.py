"""What `rfork sglang` and `rfork vllm` share (rfork.integrations.hook.launch), checked through both.

Each launcher's own refusals and command shapes are in test_sglang_hook.py and test_vllm_hook.py.
"""

from __future__ import annotations

import argparse
import json
from types import ModuleType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rfork.cli import sglang, vllm
from rfork.integrations.hook.launch import flag_values

# launcher module, its REMAINDER attribute, the least server arguments, its plugin allow-list variable
LAUNCHERS = {
    "sglang": (sglang, "sglang_args", ["--model-path", "/m"], "SGLANG_PLUGINS"),
    "vllm": (vllm, "vllm_args", ["/m"], "VLLM_PLUGINS"),
}


def _build(name: str, options: list[str], extra_args: list[str], environ: dict[str, str]):
    launcher, attr, server_args, _ = LAUNCHERS[name]
    assert isinstance(launcher, ModuleType)
    parser = argparse.ArgumentParser()
    launcher.configure(parser)
    args = parser.parse_args([*options, "--", *server_args, *extra_args])
    return launcher.build_command(args, getattr(args, attr), environ)


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_the_extra_config_merges_the_launchers_settings_over_the_users_without_the_token(name):
    options = ["--planner", "http://p:9/", "--mode", "parameters", "--provider", "tcp", "--provider", "shm"]
    plugins_var = LAUNCHERS[name][3]
    argv, env = _build(
        name,
        options,
        ["--model-loader-extra-config", '{"num_threads": 2, "mode": "checkpoint"}', "--port", "1"],
        {"RFORK_TOKEN": "tok", plugins_var: "x"},
    )
    assert argv[argv.index("--load-format") + 1] == "rfork"
    assert argv.count("--load-format") == 1
    assert argv.count("--model-loader-extra-config") == 1
    assert json.loads(argv[argv.index("--model-loader-extra-config") + 1]) == {
        "num_threads": 2,
        "planner_url": "http://p:9",
        "mode": "parameters",
        "providers": ["tcp", "shm"],
        "serve": True,
        "revision": "main",
        "transfer_timeout_s": 5.0,
        "compile_cache": True,
    }
    assert "tok" not in " ".join(argv)
    assert env["RFORK_TOKEN"] == "tok"
    assert env[plugins_var] == "x,rfork"  # an allow-list gains rfork; no list (all plugins) stays unset
    _, env = _build(name, [], [], {})
    assert plugins_var not in env


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
@pytest.mark.parametrize(
    ("options", "extra_args", "needle"),
    [
        ([], ["--model-loader-extra-config", "{not json"], "JSON"),
        # a JSON list of pairs: `rfork sglang` merged it before (dict.update), `rfork vllm` refused it
        ([], ["--model-loader-extra-config", '[["mode", "parameters"]]'], "JSON object"),
        ([], ["--model-loader-extra-config", '{"token": "t"}'], "RFORK_TOKEN"),
        ([], ["--model-loader-extra-config", '{"nope": 1}'], "unknown"),
        (["--planner", "http://p"], [], "RFORK_TOKEN"),
        (["--timeout", "0"], [], "transfer_timeout_s"),
    ],
)
def test_bad_settings_are_refused_before_the_server_starts(name, options, extra_args, needle):
    with pytest.raises(ValueError, match=needle):
        _build(name, options, extra_args, {})


@given(
    words=st.lists(st.sampled_from(["--a", "--b", "x", "y", "--load-format", "--load-format=z"]), max_size=12)
)
def test_flag_values_reads_both_spellings(words):
    values = flag_values(words, "--load-format")
    expected = []
    i = 0
    while i < len(words):
        if words[i] == "--load-format":
            expected.append(words[i + 1] if i + 1 < len(words) else "")
            i += 2
            continue
        if words[i] == "--load-format=z":
            expected.append("z")
        i += 1
    assert values == expected


def test_flag_values_maps_aliases_to_the_canonical_flag():
    words = ["--speculative-draft-model", "/d", "--speculative-draft-model-path=/e"]
    assert flag_values(words, "--speculative-draft-model-path") == ["/e"]
    aliases = {"--speculative-draft-model": "--speculative-draft-model-path"}
    assert flag_values(words, "--speculative-draft-model-path", aliases) == ["/d", "/e"]


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_the_token_file_goes_to_the_server_as_a_path_never_as_the_token(name, tmp_path):
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    argv, env = _build(
        name, ["--planner", "http://p:9", "--token-file", str(secret)], [], {"RFORK_TOKEN": "old"}
    )
    assert env["RFORK_TOKEN_FILE"] == str(secret)
    assert "RFORK_TOKEN" not in env
    assert "s3cret" not in " ".join(argv)


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_a_register_token_file_goes_to_the_server_beside_the_load_token(name, tmp_path):
    load, register = tmp_path / "load", tmp_path / "register"
    load.write_text("l0ad\n")
    register.write_text("r3gister\n")
    args = ["--planner", "http://p:9", "--token-file", str(load), "--register-token-file", str(register)]
    argv, env = _build(name, args, [], {"RFORK_REGISTER_TOKEN": "old"})
    assert (env["RFORK_TOKEN_FILE"], env["RFORK_REGISTER_TOKEN_FILE"]) == (str(load), str(register))
    assert "RFORK_REGISTER_TOKEN" not in env
    assert "r3gister" not in " ".join(argv)
    from rfork.integrations.hook.settings import HookSettings

    settings = HookSettings.resolve({}, env)
    assert (settings.token, settings.register_token, settings.seed_token) == ("l0ad", "r3gister", "r3gister")


def test_hook_settings_read_the_token_file_and_require_seed(tmp_path):
    from rfork.integrations.hook.settings import HookSettings, SettingsError

    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    env = {"RFORK_TOKEN_FILE": str(secret), "RFORK_REQUIRE_SEED": "1", "RFORK_PLANNER_URL": "http://p:9"}
    s = HookSettings.resolve({}, env)
    assert (s.token, s.require_seed, s.planner_url) == ("s3cret", True, "http://p:9")
    assert s.load_options().require_seed
    assert not s.load_options().require_crypto_digest
    strict = HookSettings.resolve({}, {**env, "RFORK_REQUIRE_CRYPTO_DIGEST": "true"})
    assert strict.load_options().require_crypto_digest
    assert strict.to_extra_config()["require_crypto_digest"] is True
    with pytest.raises(SettingsError, match="planner_url"):
        HookSettings.resolve({"planner_url": "p:9"}, {})
