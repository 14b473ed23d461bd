"""planner's public surface (moving a module never breaks a user): written once in planner/__init__.py
and checked here against the code and the docs (tests/public_surface.py); the client side imports
none of the server's stack."""

from __future__ import annotations

import subprocess
import sys

import pytest

import planner
from tests import public_surface


@pytest.mark.parametrize(
    "check",
    [
        public_surface.unresolved,
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


def test_the_client_side_does_not_import_the_server():
    """A loader or seed imports planner.client, planner.wire and planner.control_token; none of them
    may pull in SQLAlchemy, FastAPI, uvicorn or the settings (about half a second of imports)."""
    code = (
        "import sys, planner.client, planner.wire, planner.control_token, planner.integrity, planner.errors\n"
        "heavy = [m for m in ('sqlalchemy', 'fastapi', 'uvicorn', 'starlette', 'pydantic_settings',"
        " 'planner.service', 'planner.app', 'planner.db') if m in sys.modules]\n"
        "print(heavy)\n"
        "from planner import Planner\n"
        "print('sqlalchemy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout + out.stderr
