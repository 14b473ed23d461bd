"""The cffi module against its sources: the typed stub names what the module has, the cdef is read
from the C header, and the package ships the native files."""

from __future__ import annotations

import ast
from pathlib import Path

from backends.providers import _libfabric_build as build
from backends.providers._native import lib

PROVIDERS_DIR = Path(build.__file__).parent
ROOT = PROVIDERS_DIR.parent.parent


def _stub_names(class_name: str) -> set[str]:
    tree = ast.parse((PROVIDERS_DIR / "_libfabric.pyi").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    names = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
    return names


def test_the_stub_types_exactly_what_the_module_has() -> None:
    assert _stub_names("Lib") == {n for n in dir(lib) if not n.startswith("_")}


def test_the_cdef_reads_the_header_leaving_values_to_the_compiler() -> None:
    header = (
        "#ifndef X_H\n#define X_H\n#include <stdint.h>\n"
        "#define RF_BIG (1ULL << 63) /* a flag */\n#define F(x) (x)\nlong f(void);\n#endif\n"
    )
    assert build.header_cdef(header).split("\n") == ["#define RF_BIG ...", "long f(void);"]
    assert lib.RF_POST_FAILED == 1 << 63  # the value the compiler gave
    assert (lib.RF_KIND_READ, lib.RF_KIND_RECV) == (0, 3)


def test_the_package_data_ships_the_native_sources_and_the_stub() -> None:
    # the `backends = [...]` line of [tool.setuptools.package-data] (tomllib is Python >= 3.11)
    lines = (ROOT / "pyproject.toml").read_text().splitlines()
    line = next(ln for ln in lines if ln.startswith("backends = ["))
    globs = ast.literal_eval(line.split("=", 1)[1].strip())
    shipped = {p.relative_to(ROOT / "backends") for g in globs for p in (ROOT / "backends").glob(g)}
    assert all(any((ROOT / "backends").glob(g)) for g in globs), "a package-data glob matches nothing"
    needed = [PROVIDERS_DIR / "_libfabric.pyi", *(build.NATIVE / f for f in (*build.SOURCES, *build.HEADERS))]
    needed.append(build.NATIVE / "libfabric.cdef")
    assert {p.relative_to(ROOT / "backends") for p in needed} <= shipped
