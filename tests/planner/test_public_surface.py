"""planner's public surface (moving a module never breaks a user): written once in planner/__init__.py
and checked here against the code and the docs (tests/public_surface.py); the client side imports
none of the server's stack."""

from __future__ import annotations

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

