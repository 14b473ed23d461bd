"""cffi API-mode build of the libfabric binding (run by setup.py; most fi_* calls are static inline).

Headers and library are found with `pkg-config libfabric`, or under the prefix named by
RFORK_LIBFABRIC_PREFIX (e.g. /opt/amazon/efa for AWS's EFA installer).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from typing import NamedTuple

from cffi import FFI


class LibfabricPaths(NamedTuple):
    """Compiler and linker search paths (a NamedTuple: cffi execs this file outside sys.modules)."""

    include_dirs: list[str]
    library_dirs: list[str]


def find_libfabric() -> LibfabricPaths | None:
    """Where libfabric's headers and library live, or None when they cannot be found."""
    prefix = os.environ.get("RFORK_LIBFABRIC_PREFIX")
    if prefix:
        inc = os.path.join(prefix, "include")
        if os.path.exists(os.path.join(inc, "rdma", "fabric.h")):
            libdirs = [d for d in (os.path.join(prefix, "lib"), os.path.join(prefix, "lib64"))
                       if os.path.isdir(d)]
            return LibfabricPaths([inc], libdirs)
        return None
    try:
        cflags = subprocess.run(["pkg-config", "--cflags-only-I", "libfabric"], check=True,
                                capture_output=True, text=True).stdout
        libs = subprocess.run(["pkg-config", "--libs-only-L", "libfabric"], check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    incs = [f[2:] for f in shlex.split(cflags) if f.startswith("-I")]
    libdirs = [f[2:] for f in shlex.split(libs) if f.startswith("-L")]
    return LibfabricPaths(incs, libdirs)


CDEF = """
uint32_t fi_version(void);
"""

SOURCE = """
#include <rdma/fabric.h>
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
_paths = find_libfabric()
ffibuilder.set_source(
    "backends._libfabric",
    SOURCE,
    libraries=["fabric"],
    include_dirs=_paths.include_dirs if _paths else [],
    library_dirs=_paths.library_dirs if _paths else [],
    runtime_library_dirs=_paths.library_dirs if _paths else [],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
