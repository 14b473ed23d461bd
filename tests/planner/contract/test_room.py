"""The contract room (planner.contract) is what rfork and other clients import: it imports nothing of
the server room, anywhere in its code, and loading it loads none of the server's stack."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import planner.contract

CONTRACT = Path(planner.contract.__file__).resolve().parent
ROOT = CONTRACT.parent.parent
# the server's stack, and the project's other packages
FORBIDDEN = (
    *("sqlalchemy", "fastapi", "uvicorn", "starlette", "pydantic_settings", "alembic"),
    *("rfork", "backends"),
)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file: top level, in functions, under TYPE_CHECKING."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: within the room only at level 1
                base = "planner.contract" if node.level == 1 else "planner"
                out.append((node.lineno, f"{base}.{node.module}" if node.module else base))
            elif node.module:
                out.append((node.lineno, node.module))
    return out


def test_the_contract_imports_nothing_of_the_server_room():
    wrong = []
    for path in sorted(CONTRACT.rglob("*.py")):
        for line, module in _imports(path):
            top = module.split(".")[0]
            in_room = module == "planner.contract" or module.startswith("planner.contract.")
            if (top == "planner" and not in_room) or top in FORBIDDEN:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, wrong


def test_loading_the_contract_loads_none_of_the_server():
    """A loader or seed imports planner.contract and its client; none of them may pull in SQLAlchemy,
    FastAPI, uvicorn or the settings (about half a second of imports). The client's httpx loads when
    PlannerClient is first used."""
    code = (
        "import sys, planner.contract\n"
        "print('httpx' in sys.modules)\n"
        "planner.contract.PlannerClient\n"
        "heavy = [m for m in ('sqlalchemy', 'fastapi', 'uvicorn', 'starlette', 'pydantic_settings',"
        " 'planner.service', 'planner.app', 'planner.db') if m in sys.modules]\n"
        "print('httpx' in sys.modules, heavy)\n"
        "from planner import Planner\n"
        "print('sqlalchemy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split("\n")[:3] == ["False", "True []", "True"], out.stdout + out.stderr


def test_every_name_of_the_door_lives_in_the_room():
    """planner.contract re-exports its modules' names: each resolves to the object of a contract module."""
    for name in planner.contract.__all__:
        value = getattr(planner.contract, name)
        home = sys.modules[value.__module__]
        assert value.__module__.startswith("planner.contract."), name
        assert getattr(home, name) is value, name
    assert sorted(planner.contract.__all__) == sorted(set(planner.contract.__all__))
