"""Build hook: compiles the cffi (API-mode) binding to libfabric as part of the package build.

Without libfabric headers the package still installs; `import backends` then fails with one line
that names what to install (see backends/providers/_libfabric_build.py for how headers are found;
the C it compiles is in backends/providers/native/).
"""

import sys

from setuptools import setup

sys.path.insert(0, "backends/providers")
from _libfabric_build import find_libfabric  # noqa: E402

if find_libfabric() is None:
    print("rfork: libfabric headers not found; building without the transport binding", file=sys.stderr)  # noqa: T201
    setup()
else:
    setup(cffi_modules=["backends/providers/_libfabric_build.py:ffibuilder"])
