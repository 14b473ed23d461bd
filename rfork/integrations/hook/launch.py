"""What `rfork sglang` and `rfork vllm` share: their options, reading the server's flags, and the
`--load-format rfork --model-loader-extra-config JSON` they hand the server.

Imported by `rfork --help` (through the command modules), so it imports only the standard library at
the top level.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence

from rfork.errors import ConfigurationError


class LaunchError(ConfigurationError):
    """The server's arguments would bypass or break the hook; the message says which and what to do."""

    def __init__(self, message: str, *, setting: str = "server_args") -> None:
        super().__init__(message, setting=setting)


def add_hook_options(parser: argparse.ArgumentParser, *, framework: str) -> None:
    """The launcher's own options (everything but the server's arguments); `framework` names the seed.
    The spellings are rfork's one vocabulary (rfork.cli.options; old ones stay as hidden aliases)."""
    parser.add_argument(
        "--planner",
        default=os.environ.get("RFORK_PLANNER_URL") or None,
        metavar="URL",
        help="planner base URL (default: $RFORK_PLANNER_URL; none: load from disk, do not publish)",
    )
    parser.add_argument(
        "--mode",
        choices=("checkpoint", "parameters"),
        default="checkpoint",
        help="checkpoint: pull checkpoint tensors, any model (default); parameters: pull straight into "
        f"the model's parameters from an identical {framework} seed",
    )
    parser.add_argument(
        "--provider",
        "--providers",
        dest="provider",
        action="append",
        default=None,
        metavar="NAME",
        help="transport provider(s), repeat or comma-separate (default: $RFORK_PROVIDERS, else tcp)",
    )
    parser.add_argument("--no-serve", action="store_true", help="load by R-Fork but do not become a seed")
    parser.add_argument(
        "--require-seed",
        action="store_true",
        help="fail the server's start instead of loading from disk when no seed serves the weights "
        "(default: $RFORK_REQUIRE_SEED, else off)",
    )
    parser.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="neither fetch the engine's compile cache from a seed nor serve one's own (vLLM)",
    )
    parser.add_argument(
        "--model-name",
        "--model",
        dest="model_name",
        default=None,
        metavar="NAME",
        help="model name in the identity (default: from config.json)",
    )
    parser.add_argument("--revision", default="main", help="model revision in the identity (default main)")
    parser.add_argument("--timeout", type=float, default=5.0, help="dead-peer timeout for transfers, seconds")
    parser.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="file holding the planner token with the load role, and the register role unless "
        "--register-token-file gives one (passed to the server as $RFORK_TOKEN_FILE; default: "
        "$RFORK_TOKEN or $RFORK_TOKEN_FILE)",
    )
    parser.add_argument(
        "--register-token-file",
        default=None,
        metavar="PATH",
        help="file holding the planner token with the register role, to become a seed (passed to the "
        "server as $RFORK_REGISTER_TOKEN_FILE; default: $RFORK_REGISTER_TOKEN or "
        "$RFORK_REGISTER_TOKEN_FILE, else the --token-file token)",
    )
    parser.add_argument(
        "--insecure",
        "--insecure-ok",
        dest="insecure",
        action="store_true",
        help="the planner runs without auth: send no token",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the command, do not start it")


def token_environment(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """The server's environment with `--token-file` as $RFORK_TOKEN_FILE (the token itself stays out
    of argv and the environment); LaunchError when a planner is given without any token."""
    env = dict(environ)
    for flag, given, name in (
        ("--token-file", args.token_file, "RFORK_TOKEN"),
        ("--register-token-file", args.register_token_file, "RFORK_REGISTER_TOKEN"),
    ):
        if not given:
            continue
        path = os.path.abspath(given)
        try:
            with open(path, encoding="utf-8") as f:
                readable = bool(f.read().strip())
        except OSError as exc:
            raise LaunchError(f"{flag} {given}: {exc.strerror or exc}") from exc
        if not readable:
            raise LaunchError(f"{flag} {given} is empty")
        env.pop(name, None)
        env[f"{name}_FILE"] = path
    has_token = env.get("RFORK_TOKEN") or env.get("RFORK_TOKEN_FILE")
    if args.planner and not has_token and not args.insecure:
        raise LaunchError(
            "no planner token: pass --token-file, set $RFORK_TOKEN or $RFORK_TOKEN_FILE, or --insecure for a "
            "planner without auth"
        )
    return env


def server_args(given: Sequence[str], usage: str) -> list[str]:
    """The server's arguments (what follows `--`); LaunchError with `usage` when there are none."""
    rest = list(given)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        raise LaunchError(usage)
    return rest


def flag_values(args: Sequence[str], flag: str, aliases: Mapping[str, str] | None = None) -> list[str]:
    """Every value given to `flag` (as `--flag V` or `--flag=V`; `aliases` maps other spellings to
    canonical names); [] when absent."""
    names = aliases or {}
    out: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        name, eq, value = word.partition("=")
        if names.get(name, name) == flag:
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
    """`args` without `flag` and its value (either spelling)."""
    out: list[str] = []
    skip = False
    for word in args:
        if skip:
            skip = False
            continue
        name, eq, _ = word.partition("=")
        if name == flag:
            skip = not eq
            continue
        out.append(word)
    return out


def with_rfork_load_format(
    args: argparse.Namespace, server_args: Sequence[str], environ: Mapping[str, str]
) -> list[str]:
    """`server_args` loading by R-Fork: `--load-format rfork` and the extra config of the launcher's
    options merged over the user's; raises LaunchError / SettingsError (the server's own check)."""
    # imported here: `rfork --help` imports every command module, which must stay light (start-up time)
    from rfork.integrations.hook.settings import HookSettings

    given = args.provider or [environ.get("RFORK_PROVIDERS") or "tcp"]
    providers = [p.strip() for v in given for p in v.split(",") if p.strip()]
    settings = HookSettings(
        planner_url=args.planner.rstrip("/") if args.planner else None,
        mode=args.mode,
        providers=tuple(providers),
        serve=not args.no_serve,
        compile_cache=not args.no_compile_cache,
        require_seed=args.require_seed or _truthy(environ.get("RFORK_REQUIRE_SEED")),
        model=args.model_name,
        revision=args.revision,
        transfer_timeout_s=args.timeout,
    )
    extra: dict[str, object] = {}
    for given in flag_values(server_args, "--model-loader-extra-config"):
        try:
            parsed = json.loads(given)
        except (ValueError, TypeError) as exc:
            raise LaunchError(f"--model-loader-extra-config is not a JSON object: {exc}") from exc
        if not isinstance(parsed, dict):
            raise LaunchError("--model-loader-extra-config is not a JSON object")
        extra.update(parsed)
    extra.update(settings.to_extra_config())
    HookSettings.resolve(extra, {})  # the same check the server will run, before anything starts
    rest = without_flag(without_flag(server_args, "--load-format"), "--model-loader-extra-config")
    return [*rest, "--load-format", "rfork", "--model-loader-extra-config", json.dumps(extra)]


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def with_plugin_enabled(environ: Mapping[str, str], plugins_var: str) -> dict[str, str]:
    """The server's environment: rfork added to a plugin allow-list, when one is set (unset loads all)."""
    env = dict(environ)
    plugins = [p for p in env.get(plugins_var, "").split(",") if p.strip()]
    if plugins and "rfork" not in plugins:
        env[plugins_var] = ",".join([*plugins, "rfork"])
    return env


def exec_server(argv: Sequence[str], env: Mapping[str, str], *, dry_run: bool) -> int:
    """Replace this process by the server (never returns), or print its command with `dry_run`."""
    if dry_run:
        sys.stdout.write(shlex.join(argv) + "\n")
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], list(argv), dict(env))
    return 0  # pragma: no cover - exec does not return
