"""Build hook: the packages the wheel ships, and the cffi (API-mode) binding to libfabric.

- Without libfabric's headers the build fails and says what to install. RFORK_SKIP_NATIVE=1 builds
  without the binding on purpose: a pure `py3-none-any` wheel that runs the planner (`import backends`
  then fails with one line saying the binding is missing).
- With the binding the wheel is tagged `cp310-abi3-linux_<arch>`: cffi compiles against Python's stable
  ABI (`.abi3.so`), so one wheel serves CPython 3.10 and later. It links libfabric.so.1 and
  libxxhash.so.0 by soname and carries no RUNPATH (neither the build's libfabric prefix nor the
  building Python's lib directory): libfabric is found at run time (backends/providers/_native.py:
  the system loader's, $RFORK_LIBFABRIC_PREFIX's, or the `mpich` wheel's copy).
- The repository's top-level `migrations/` ships as `planner/migrations` (planner.db finds it by
  path): a generic top-level name would meet every Django, Flask or Alembic project's own folder.

backends/providers/_libfabric_build.py says how headers are found; the C is in backends/providers/native/.
"""

import os
import sys

from setuptools import find_namespace_packages, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, "backends/providers")
from _libfabric_build import find_libfabric  # noqa: E402

SKIP_NATIVE_ENV = "RFORK_SKIP_NATIVE"


class BuildWithoutRunpath(build_ext):
    """build_ext without the `-Wl,-rpath,...` that some Pythons (pyenv, conda) put in LDSHARED."""

    def build_extensions(self) -> None:
        linker = self.compiler.linker_so
        self.compiler.linker_so = [a for a in linker if not a.startswith(("-Wl,-rpath", "-Wl,-R", "-R"))]
        super().build_extensions()


def _native_kwargs() -> dict:
    if os.environ.get(SKIP_NATIVE_ENV, "").strip().lower() in ("1", "true", "yes"):
        print(f"rfork: {SKIP_NATIVE_ENV} set: building without the transport binding", file=sys.stderr)  # noqa: T201
        return {}
    if find_libfabric() is None:
        raise SystemExit(
            "rfork: libfabric's headers were not found (pkg-config libfabric, or "
            "$RFORK_LIBFABRIC_PREFIX/include). Install libfabric >= 1.17 with headers (Debian/Ubuntu: "
            "libfabric-dev; Fedora: libfabric-devel), or set RFORK_LIBFABRIC_PREFIX=/opt/amazon/efa; "
            f"to build a planner-only wheel without the transport binding, set {SKIP_NATIVE_ENV}=1."
        )
    return {
        "cffi_modules": ["backends/providers/_libfabric_build.py:ffibuilder"],
        "cmdclass": {"build_ext": BuildWithoutRunpath},
        "options": {"bdist_wheel": {"py_limited_api": "cp310"}},
    }


setup(
    # namespace discovery: data-only folders (planner/ui, backends/providers/native) are packages too
    packages=[
        *find_namespace_packages(
            include=["rfork", "rfork.*", "planner", "planner.*", "backends", "backends.*"],
            exclude=["*__pycache__"],
        ),
        "planner.migrations",
        "planner.migrations.versions",
    ],
    package_dir={"planner.migrations": "migrations"},  # package data: pyproject.toml
    **_native_kwargs(),
)
