"""Start an unmodified SGLang server that loads by R-Fork and becomes a seed (rfork sglang ... -- ARGS)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence

# SGLang flags (value-taking) that the launcher reads or refuses; aliases map to the canonical name.
_FLAG_ALIASES = {"--speculative-draft-model": "--speculative-draft-model-path"}
_SERVER_MODULE = "sglang.launch_server"


class LaunchError(ValueError):
    """The SGLang arguments would bypass or break the hook; the message says which and what to do."""


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork sglang`; everything after `--` goes to SGLang unchanged."""
    parser.add_argument(
        "--planner", default=os.environ.get("RFORK_PLANNER_URL"), help="planner base URL ($RFORK_PLANNER_URL)"
    )
    parser.add_argument(
        "--mode",
        choices=("checkpoint", "parameters"),
        default="checkpoint",
        help="checkpoint: pull checkpoint tensors, any model (default); parameters: pull straight into "
        "the model's parameters from an identical SGLang seed",
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
        "sglang_args",
        nargs=argparse.REMAINDER,
        help="-- then SGLang's arguments (e.g. --model-path DIR), or a full command (sglang serve ...)",
    )


def flag_values(args: Sequence[str], flag: str) -> list[str]:
    """Every value given to `flag` (as `--flag V` or `--flag=V`, aliases included); [] when absent."""
    out: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        name, eq, value = word.partition("=")
        if _FLAG_ALIASES.get(name, name) == flag:
            if eq:
                out.append(value)
            elif i + 1 < len(args):
                out.append(args[i + 1])
                i += 1
            else:
                out.append("")
        i += 1
    return out


def without_flag(args: Sequence[str], flag: str) -> list[str]:
    out: list[str] = []
    skip = False
    for word in args:
        if skip:
            skip = False
            continue
        name, eq, _ = word.partition("=")
        if _FLAG_ALIASES.get(name, name) == flag:
            skip = not eq
            continue
        out.append(word)
    return out


def check_sglang_args(args: Sequence[str]) -> None:
    """Refuse the SGLang modes that bypass or break `--load-format rfork` (LaunchError says why)."""
    for mode in flag_values(args, "--weight-cache-mode"):
        if mode != "off":
            raise LaunchError(
                f"--weight-cache-mode {mode} replaces the load format with SGLang's IPC weight cache, "
                "which bypasses rfork; drop it (or use --weight-cache-mode off)"
            )
    for mode in flag_values(args, "--startup-weight-load-mode"):
        if mode == "overlap":
            raise LaunchError(
                "--startup-weight-load-mode overlap accepts SGLang's DefaultModelLoader only; "
                "use serial (the default) with rfork"
            )
    formats = flag_values(args, "--load-format")
    if any(f != "rfork" for f in formats):
        raise LaunchError(
            f"--load-format {formats[-1]} conflicts with rfork sglang (it sets --load-format rfork)"
        )
    drafts = flag_values(args, "--speculative-draft-model-path")
    algorithms = [a for a in flag_values(args, "--speculative-algorithm") if a.upper() != "NGRAM"]
    if drafts or algorithms:
        plan = flag_values(args, "--speculative-draft-load-format")
        if not plan or plan[-1] == "rfork":
            raise LaunchError(
                "a draft model would load with --load-format rfork, and rfork has no plan for draft "
                "weights: pass --speculative-draft-load-format auto (the draft loads from disk)"
            )


def build_command(
    args: argparse.Namespace, sglang_args: Sequence[str], environ: Mapping[str, str]
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of the SGLang server to exec; raises LaunchError / SettingsError."""
    # imported here: `rfork --help` imports every command module, which must stay light (start-up time)
    from rfork.integrations.sglang.settings import HookSettings

    rest = list(sglang_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        raise LaunchError("no SGLang arguments: rfork sglang [options] -- --model-path DIR [...]")
    command, rest = ([sys.executable, "-m", _SERVER_MODULE], rest) if rest[0].startswith("-") else ([], rest)
    check_sglang_args(rest)
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
            extra.update(json.loads(given))
        except (ValueError, TypeError) as exc:
            raise LaunchError(f"--model-loader-extra-config is not a JSON object: {exc}") from exc
    extra.update(settings.to_extra_config())
    HookSettings.resolve(extra, {})  # the same check the server will run, before anything starts
    rest = without_flag(without_flag(rest, "--load-format"), "--model-loader-extra-config")
    argv = [*command, *rest, "--load-format", "rfork", "--model-loader-extra-config", json.dumps(extra)]
    env = dict(environ)
    plugins = [p for p in env.get("SGLANG_PLUGINS", "").split(",") if p.strip()]
    if plugins and "rfork" not in plugins:
        env["SGLANG_PLUGINS"] = ",".join([*plugins, "rfork"])
    return argv, env


def run(args: argparse.Namespace) -> int:
    """Check the arguments, then exec SGLang (it never returns unless --dry-run)."""
    argv, env = build_command(args, args.sglang_args, os.environ)
    if args.dry_run:
        print(shlex.join(argv))
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, env)
    return 0  # pragma: no cover - exec does not return
