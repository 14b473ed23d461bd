"""cffi API-mode build of the native module `backends.providers._libfabric` (run by setup.py).

The C lives in native/: fabric.c (fabric helpers), digest_job.c (digest jobs), progress_core.c (the
progress core). The cdef is native/libfabric.cdef (the libfabric calls Python makes; cffi syntax)
followed by native/rf_api.h, the module's own declarations, which the C files include too.
libfabric's headers and library are found with `pkg-config libfabric`, or under the prefix named by
RFORK_LIBFABRIC_PREFIX (e.g. /opt/amazon/efa for AWS's EFA installer); xxHash's with
`pkg-config libxxhash`, and without it the module builds without native digests. The module carries
no RUNPATH (setup.py): which libfabric.so.1 it binds to is chosen at run time (_native.py).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import NamedTuple

from cffi import FFI

NATIVE = Path(__file__).parent / "native"
SOURCES = ("fabric.c", "digest_job.c", "progress_core.c")
HEADERS = ("rf_api.h", "rf_internal.h")


class NativePaths(NamedTuple):
    """Compiler and linker search paths (a NamedTuple: cffi execs this file outside sys.modules)."""

    include_dirs: list[str]
    library_dirs: list[str]


def find_libfabric() -> NativePaths | None:
    """Where libfabric's headers and library live, or None when they cannot be found."""
    prefix = os.environ.get("RFORK_LIBFABRIC_PREFIX")
    if prefix:
        inc = os.path.join(prefix, "include")
        if os.path.exists(os.path.join(inc, "rdma", "fabric.h")):
            libdirs = [d for d in (os.path.join(prefix, "lib"), os.path.join(prefix, "lib64"))
                       if os.path.isdir(d)]
            return NativePaths([inc], libdirs)
        return None
    return pkg_config_paths("libfabric")


def find_xxhash() -> NativePaths | None:
    """Where xxHash's header and library live (Debian: libxxhash-dev), or None: the module then
    builds without native digests (rf_hjob_supported() is 0) and pulls hash in Python."""
    return pkg_config_paths("libxxhash")


def pkg_config_paths(package: str) -> NativePaths | None:
    """The include and library directories pkg-config gives for package, or None without them."""
    try:
        cflags = subprocess.run(["pkg-config", "--cflags-only-I", package], check=True,
                                capture_output=True, text=True).stdout
        libs = subprocess.run(["pkg-config", "--libs-only-L", package], check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return NativePaths([f[2:] for f in shlex.split(cflags) if f.startswith("-I")],
                       [f[2:] for f in shlex.split(libs) if f.startswith("-L")])


def header_cdef(header: str) -> str:
    """A C header as cffi's cdef reads it: `#define NAME value` becomes `#define NAME ...` (the
    compiler supplies the value), every other preprocessor line is dropped."""
    out = []
    for line in header.splitlines():
        constant = re.match(r"#\s*define\s+(\w+)\s+\S", line)
        if constant:
            out.append(f"#define {constant.group(1)} ...")
        elif not line.lstrip().startswith("#"):
            out.append(line)
    return "\n".join(out)


def _rel(path: Path) -> str:
    return os.path.relpath(path)  # setuptools wants paths relative to where setup.py runs


ffibuilder = FFI()
ffibuilder.cdef((NATIVE / "libfabric.cdef").read_text() + header_cdef((NATIVE / "rf_api.h").read_text()))
_fabric = find_libfabric() or NativePaths([], [])
_xxh = find_xxhash()
_xxh_paths = _xxh or NativePaths([], [])
ffibuilder.set_source(
    "backends.providers._libfabric",
    '#include "rf_api.h"\n',
    sources=[_rel(NATIVE / s) for s in SOURCES],
    depends=[_rel(NATIVE / h) for h in HEADERS],
    define_macros=[("RF_HAVE_XXHASH", "1")] if _xxh else [],
    libraries=["fabric", "pthread"] + (["xxhash"] if _xxh else []),
    include_dirs=[_rel(NATIVE), *_fabric.include_dirs, *_xxh_paths.include_dirs],
    library_dirs=_fabric.library_dirs + _xxh_paths.library_dirs,
    # no runtime_library_dirs: the module finds libfabric at run time (_native.py), not where it was built
)

if __name__ == "__main__":
    # A direct build (scripts/gpu_check.sh): the extension alone, in place. Not ffibuilder.compile():
    # its setuptools Distribution names no packages, so setuptools' discovery refuses this repository's
    # several top-level packages.
    from setuptools import Distribution

    dist = Distribution(
        {"name": "rfork-binding", "ext_modules": [ffibuilder.distutils_extension(tmpdir="build/cffi")],
         "packages": [], "py_modules": []}
    )  # fmt: skip
    dist.get_command_obj("build_ext").inplace = True
    dist.run_command("build_ext")
