"""deploy/ stays true to the CLI: every rfork command line in compose, Kubernetes and systemd parses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from rfork.cli import build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _yaml_commands() -> list[tuple[str, list[str]]]:
    found: list[tuple[str, list[str]]] = []
    for path in sorted(DEPLOY.rglob("*.yml")) + sorted(DEPLOY.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            stack = [doc]
            while stack:
                node = stack.pop()
                if isinstance(node, dict):
                    for key in ("command", "args"):
                        value = node.get(key)
                        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
                            found.append((f"{path.name}:{key}", value))
                    stack.extend(node.values())
                elif isinstance(node, list):
                    stack.extend(node)
    return found


def _systemd_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in sorted((DEPLOY / "systemd").glob("*.service")):
        for line in path.read_text().splitlines():
            m = re.match(r"^Exec\w+=(\S*/rfork)\s+(.*)$", line)
            if m:
                found.append((path.name, shlex.split(m.group(2))))
    return found


COMMANDS = _yaml_commands() + _systemd_commands()


def test_deploy_files_were_found() -> None:
    names = {where.split(":")[0] for where, _ in COMMANDS}
    assert {"docker-compose.yml", "planner.yaml", "seed.yaml", "rfork-planner.service",
            "rfork-seed@.service"} <= names


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_command_line_parses(where: str, argv: list[str]) -> None:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse's way of refusing
        pytest.fail(f"{where}: `rfork {' '.join(argv)}` is refused by the CLI (exit {exc.code})")
    assert args._module is not None


SECRET_FLAGS = ("--db", "--token", "--register-token")
SECRET_TEXT = re.compile(r"://[^/\s:@]+:[^@\s]+@|rfi_|secret|password", re.IGNORECASE)


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_no_secret_on_a_command_line(where: str, argv: list[str]) -> None:
    """Database URLs (with their password) and tokens go in the environment: argv is world-readable."""
    for flag in SECRET_FLAGS:
        assert flag not in argv, f"{where}: {flag} on the command line; use its RFORK_* variable"
    for word in argv:
        assert not SECRET_TEXT.search(word), f"{where}: {word!r} looks like a secret on the command line"


def test_dockerfile_installs_what_setup_script_installs() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    script = (DEPLOY.parent / "scripts" / "dev.sh").read_text()
    for package in ("libfabric1", "libfabric-dev"):
        assert package in dockerfile
        assert package in script
    torch_pin = re.search(r"torch==[\d.]+", script)
    assert torch_pin
    assert torch_pin.group(0) in dockerfile
