"""One vocabulary: global flags anywhere, one name per concept (old spellings hidden, warned about),
defaults and variables in help, every documented RFORK_* variable honoured by its command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rfork.cli import build_parser, main
from rfork.cli.options import DEPRECATED
from tests.rfork_cli import run_rfork

# command -> the variables its --help must name (each one is read by the command: tests below and
# tests/rfork/cli/test_settings_fail_loud.py, tests/rfork/test_operators.py)
VARIABLES = {
    ("load",): [
        "RFORK_PLANNER_URL",
        "RFORK_PROVIDERS",
        "RFORK_TOKEN",
        "RFORK_TOKEN_FILE",
        "RFORK_REGISTER_TOKEN",
        "RFORK_REGISTER_TOKEN_FILE",
        "RFORK_REQUIRE_SEED",
        "RFORK_REQUIRE_CRYPTO_DIGEST",
        "RFORK_METRICS_PORT",
        "RFORK_METRICS_HOST",
        "RFORK_NODE",
        "RFORK_RACK",
        "RFORK_ZONE",
        "RFORK_LOG_FORMAT",
    ],
    ("seed",): [
        "RFORK_PLANNER_URL",
        "RFORK_PROVIDERS",
        "RFORK_ANCHOR_TOKEN",
        "RFORK_ANCHOR_TOKEN_FILE",
        "RFORK_REGISTER_TOKEN",
        "RFORK_METRICS_PORT",
        "RFORK_NODE",
        "RFORK_RACK",
        "RFORK_ZONE",
    ],
    ("fleet",): ["RFORK_PLANNER_URL", "RFORK_READER_TOKEN", "RFORK_READER_TOKEN_FILE"],
    ("anchor",): ["RFORK_PLANNER_URL", "RFORK_ADMIN_TOKEN", "RFORK_ADMIN_TOKEN_FILE"],
    ("vllm",): [
        "RFORK_PLANNER_URL",
        "RFORK_PROVIDERS",
        "RFORK_TOKEN",
        "RFORK_TOKEN_FILE",
        "RFORK_REQUIRE_SEED",
    ],
    ("sglang",): [
        "RFORK_PLANNER_URL",
        "RFORK_PROVIDERS",
        "RFORK_TOKEN",
        "RFORK_TOKEN_FILE",
        "RFORK_REQUIRE_SEED",
    ],
    ("planner", "serve"): [
        "RFORK_DB_URL",
        "RFORK_ADMIN_TOKEN",
        "RFORK_ADMIN_TOKEN_FILE",
        "RFORK_READER_TOKEN",
        "RFORK_LOAD_TOKEN",
        "RFORK_REGISTER_TOKEN",
        "RFORK_ANCHOR_TOKEN",
        "RFORK_SELECTION_POLICY",
        "RFORK_RACK_HOLD",
        "RFORK_CONTROL_SECRET",
    ],
}


def _help(capsys: pytest.CaptureFixture[str], *path: str) -> str:
    with pytest.raises(SystemExit):
        main([*path, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


@pytest.mark.parametrize("path", list(VARIABLES))
def test_help_names_every_variable_of_the_command(path, capsys):
    text = _help(capsys, *path)
    missing = [v for v in VARIABLES[path] if f"${v}" not in text and v not in text]
    assert missing == []


@pytest.mark.parametrize(
    "path", [("load",), ("seed",), ("digest",), ("sglang",), ("vllm",), ("planner", "serve")]
)
def test_help_shows_defaults_and_no_deprecated_spelling(path, capsys):
    text = _help(capsys, *path)
    assert "default" in text
    shown = {w.strip("[],") for w in text.split() if w.startswith(("--", "[--"))}
    assert not shown & set(DEPRECATED), shown & set(DEPRECATED)


def test_one_name_per_concept_across_commands():
    parser = build_parser()
    leaves = {}

    def walk(p, path):
        for action in p._actions:
            if hasattr(action, "choices") and isinstance(action.choices, dict):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))
        leaves[path] = {s for a in p._actions for s in a.option_strings}

    walk(parser, ())
    for path, flags in leaves.items():
        for old, new in DEPRECATED.items():
            if old in flags and old != "--then":
                assert new in flags, (path, old)  # an old spelling is only ever an alias of the new one
    assert {"--insecure", "--model-name", "--no-serve", "--provider", "--max-concurrent-pulls"} <= leaves[
        ("load",)
    ] | {"--model-name"}
    for cmd in (("seed",), ("sglang",), ("vllm",), ("load",)):
        assert {"--insecure", "--provider", "--token-file"} <= leaves[cmd], cmd


def test_global_flags_go_anywhere_and_old_spellings_still_work_with_a_warning(small_ckpt, tmp_path, capsys):
    # main: `-v` after the command was "unrecognized arguments"; digest refused a .safetensors file
    (one_file,) = sorted(small_ckpt.glob("*.safetensors"))[:1]
    out = tmp_path / "anchors.json"
    status, _, err = run_rfork(
        [
            "digest",
            "--checkpoint",
            str(one_file),
            "-v",
            "--model",
            "m",
            "--out",
            str(out),
            "--log-format",
            "json",
        ],
        capsys,
    )
    assert status == 0, err
    bodies = json.loads(out.read_text())
    assert bodies[0]["identity"]["model"] == "m"
    records = [json.loads(line) for line in err.splitlines()]
    assert any(r["level"] == "WARNING" and "--model is now --model-name" in r["message"] for r in records)


def test_the_checkpoint_identity_names_the_layout_not_the_release(small_ckpt: Path):
    from rfork.identity import CHECKPOINT_LAYOUT
    from rfork.weights.checkpoint import read_checkpoint_info

    ident = read_checkpoint_info(small_ckpt).identity()
    assert (ident.framework, ident.framework_version) == ("rfork", CHECKPOINT_LAYOUT)
