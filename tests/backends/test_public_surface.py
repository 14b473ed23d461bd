"""backends' public surface is deliberate: the names `from backends import ...` offers, and those of its
paths, so moving a module never breaks a user silently.

The lists are written once (backends/__init__.py's `__all__`, and each path's); these tests check them
against the code and the docs (tests/public_surface.py) and that importing backends stays light.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import backends
from tests import public_surface

CHECKS = [public_surface.unresolved, public_surface.lazy_but_unlisted, public_surface.left_out]


@pytest.mark.parametrize(
    "check", [*CHECKS, public_surface.unexported_errors, public_surface.documented_but_not_public]
)
def test_the_surface_agrees_with_the_code_and_the_docs(check) -> None:
    assert check(backends) == []


@pytest.mark.parametrize("path", ["kv", "rl", "moe", "nccl"])
@pytest.mark.parametrize("check", CHECKS)
def test_the_paths_export_their_public_names(path: str, check) -> None:
    assert path in backends.__all__
    assert check(getattr(backends, path)) == []


def test_every_error_is_a_transfer_error() -> None:
    paths = (backends.kv.KvError, backends.rl.RLError, backends.moe.MoEError, backends.nccl.NcclTransferError)
    for error in (*paths, backends.ChannelError):
        assert issubclass(error, backends.TransferError)


def test_importing_backends_loads_no_path_and_no_torch() -> None:
    probe = "import backends, sys; print(sorted(m for m in sys.modules if m in ('torch', 'backends.kv', "
    probe += "'backends.rl', 'backends.moe', 'backends.nccl')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_pure_modules_need_neither_the_binding_nor_the_engine() -> None:
    probe = "import backends.layout, backends.sharding, backends.nccl, sys; "
    probe += "print(sorted(m for m in sys.modules if m.startswith(('backends.providers', 'backends.eng'))))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
