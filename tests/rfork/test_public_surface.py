"""rfork's public surface: the names a framework hook and a user import from `rfork`.

The list is written once, in rfork/__init__.py; these tests check it against the code and the docs
(tests/public_surface.py) and that importing rfork stays light.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import rfork
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
    assert check(rfork) == []


def test_the_errors_share_one_base() -> None:
    for name in (
        "PullError",
        "LoadFailed",
        "ChecksumMismatch",
        "DestinationMismatch",
        "CheckpointError",
        "ManifestError",
        "LayoutError",
    ):
        assert issubclass(getattr(rfork, name), rfork.RforkError), name


def test_importing_rfork_is_light_until_a_name_is_used() -> None:
    code = (
        "import sys, rfork\n"
        "heavy = [m for m in ('torch', 'backends', 'planner', 'httpx') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
        "rfork.Loader\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    before, after = out.stdout.splitlines()
    assert before == ""
    assert after == "True"


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        rfork.no_such_name  # noqa: B018
