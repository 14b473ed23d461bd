"""Start an unmodified SGLang server that loads by R-Fork and becomes a seed (rfork sglang ... -- ARGS)."""

from __future__ import annotations

import argparse
import os
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

# SGLang flags (value-taking) that the launcher reads or refuses; aliases map to the canonical name.
_FLAG_ALIASES = {"--speculative-draft-model": "--speculative-draft-model-path"}
_SERVER_MODULE = "sglang.launch_server"


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork sglang`; everything after `--` goes to SGLang unchanged."""
    add_hook_options(parser, framework="SGLang")
    parser.add_argument(
        "sglang_args",
        nargs=argparse.REMAINDER,
        help="-- then SGLang's arguments (e.g. --model-path DIR), or a full command (sglang serve ...)",
    )


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
    drafts = flag_values(args, "--speculative-draft-model-path", _FLAG_ALIASES)
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
    rest = server_args(sglang_args, "no SGLang arguments: rfork sglang [options] -- --model-path DIR [...]")
    command, rest = ([sys.executable, "-m", _SERVER_MODULE], rest) if rest[0].startswith("-") else ([], rest)
    check_sglang_args(rest)
    argv = [*command, *with_rfork_load_format(args, rest, environ)]
    return argv, with_plugin_enabled(token_environment(args, environ), "SGLANG_PLUGINS")


def run(args: argparse.Namespace) -> int:
    """Check the arguments, then exec SGLang (it never returns unless --dry-run)."""
    argv, env = build_command(args, args.sglang_args, os.environ)
    return exec_server(argv, env, dry_run=args.dry_run)
