"""planner's public surface (moving a module never breaks a user): written once in planner/__init__.py
and checked here against the code and the docs (tests/public_surface.py); the client side imports
none of the server's stack."""

from __future__ import annotations

import subprocess
import sys

import pytest

import planner
import planner.contract
from tests import public_surface


@pytest.mark.parametrize(
    "check",
    [
        public_surface.unresolved,
        public_surface.lazy_but_unlisted,
        public_surface.left_out,
        public_surface.unexported_errors,
        public_surface.documented_but_not_public,
    ],
)
def test_the_surface_agrees_with_the_code_and_the_docs(check) -> None:
    assert check(planner) == []


def test_unknown_names_are_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        planner.Nope  # noqa: B018 - the access is the test



@pytest.mark.parametrize("check", [public_surface.unresolved, public_surface.lazy_but_unlisted])
def test_the_contracts_list_agrees_with_its_code(check) -> None:
    assert check(planner.contract) == []


def test_importing_planner_loads_no_pydantic_and_no_server() -> None:
    """`rfork --help` imports planner.selection, so the package's `__init__` (and the contract's list
    it spreads) must stay standard library only."""
    probe = "import planner, sys; print(sorted(m for m in sys.modules if m.split('.')[0] in "
    probe += "('pydantic', 'httpx', 'sqlalchemy', 'fastapi')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
