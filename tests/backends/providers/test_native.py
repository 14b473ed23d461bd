"""Which libfabric rfork loads at run time (RFORK_LIBFABRIC_LIB), checked in fresh processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from backends.providers._native import chosen_library, mpich_libfabric

_REPORT = "from backends.providers import _native as n; print('%d.%d' % n.VERSION, n.LIBRARY or 'system')"


def _loaded(setting: str | None, **extra: str) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RFORK_LIBFABRIC_LIB", "RFORK_LIBFABRIC_PREFIX")}
    if setting is not None:
        env["RFORK_LIBFABRIC_LIB"] = setting
    env.update(extra)
    out = subprocess.run([sys.executable, "-c", _REPORT], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    version, library = out.stdout.split()
    return version, library


def test_system_is_the_default_and_the_linked_one() -> None:
    for setting in (None, "system"):
        version, library = _loaded(setting)
        assert library == "system"
        assert tuple(int(x) for x in version.split(".")) >= (1, 17)


@pytest.mark.skipif(mpich_libfabric() is None, reason="the mpich wheel (extra libfabric2) is not installed")
def test_mpich_or_a_path_loads_the_wheels_libfabric_2() -> None:
    path = mpich_libfabric()
    for setting in ("mpich", str(path)):
        version, library = _loaded(setting)
        assert library == path
        assert version.startswith("2."), version


def test_bad_settings_are_one_clear_error(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(ImportError, match="no such file"):
        chosen_library(str(tmp_path) + "/missing.so.1")
    assert chosen_library("system") is None
    env = {**os.environ, "RFORK_LIBFABRIC_LIB": "/nonexistent/libfabric.so.1"}
    out = subprocess.run([sys.executable, "-c", _REPORT], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "RFORK_LIBFABRIC_LIB='/nonexistent/libfabric.so.1': no such file" in out.stderr


def test_a_prefix_picks_its_libfabric(tmp_path: os.PathLike[str]) -> None:
    """RFORK_LIBFABRIC_PREFIX at run time (AWS EFA: /opt/amazon/efa), as the binding has no RUNPATH."""
    from pathlib import Path

    lib = Path(tmp_path) / "lib64" / "libfabric.so.1"
    lib.parent.mkdir()
    lib.write_bytes(b"")
    assert chosen_library(None, str(tmp_path)) == str(lib.resolve())
    assert chosen_library("mpich", None) in (None, mpich_libfabric())  # the setting wins over no prefix
    with pytest.raises(ImportError, match="RFORK_LIBFABRIC_PREFIX='/nonexistent'"):
        chosen_library("system", "/nonexistent")


_SIGNALLED = """
import os, signal, sys, faulthandler
faulthandler.enable()
got = []
signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job inherits it ignored
signal.signal(signal.SIGTERM, lambda signum, _frame: got.append(signum))
from backends.providers import _native
os.kill(os.getpid(), signal.SIGTERM)
try:
    os.kill(os.getpid(), signal.SIGINT)
except KeyboardInterrupt:
    got.append(int(signal.SIGINT))
print(sorted(got))
"""


def test_loading_the_binding_keeps_the_processs_signal_handlers() -> None:
    """The libraries libfabric loads may install C-level handlers of their own (SIGINT, SIGTERM,
    SIGSEGV, ...); after the import, a signal still reaches the handlers the process had before."""
    out = subprocess.run([sys.executable, "-c", _SIGNALLED], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.split("\n")[0]) == (0, "[2, 15]"), out
    assert out.stderr == ""
