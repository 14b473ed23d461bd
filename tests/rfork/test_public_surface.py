"""rfork's public surface: the names a framework hook and a user import from `rfork`, pinned.

Adding or removing a public name is a visible change: update this list in the same commit.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import rfork

PUBLIC = [
    "Attempt",
    "CheckpointError",
    "CheckpointInfo",
    "ChecksumMismatch",
    "DestinationMismatch",
    "LayoutError",
    "LoadFailed",
    "LoadOptions",
    "LoadResult",
    "Loader",
    "ManifestError",
    "PullError",
    "RankWeights",
    "RforkError",
    "Seed",
    "SourceIdentity",
    "__version__",
    "load",
    "pull_into",
    "read_checkpoint_info",
    "warm_transport",
]


def test_rfork_exports_exactly_the_pinned_names() -> None:
    assert sorted(rfork.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(rfork, name) is not None, name


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
