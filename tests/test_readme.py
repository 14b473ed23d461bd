"""README.md's Python examples: every import they show works, as a new user would run it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _imports() -> list[str]:
    """The import statements of every ```python block of the README, in order."""
    out = []
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S):
        lines = [ln for ln in block.splitlines() if not ln.startswith(" ")]  # top-level statements only
        for node in ast.parse(
            "\n".join(ln for ln in lines if ln.startswith(("import ", "from "))) or ""
        ).body:
            out.append(ast.unparse(node))
    return out


def test_readme_shows_imports() -> None:
    assert any(s.startswith("from rfork import") for s in _imports())
    assert any(s.startswith("from backends import") for s in _imports())


def test_every_import_the_readme_shows_works_in_a_fresh_process() -> None:
    code = "\n".join(_imports())
    proc = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_module_paths_rfork_01_taught_still_import_with_a_warning() -> None:
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from rfork.checkpoint import read_checkpoint_info\n"
        "    from rfork.loader import Loader, LoadOptions, load\n"
        "import rfork\n"
        "assert Loader is rfork.Loader and read_checkpoint_info is rfork.read_checkpoint_info\n"
        "print(sorted({str(w.message) for w in caught if w.category is DeprecationWarning}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "rfork.loader is deprecated" in proc.stdout
    assert "rfork.checkpoint is deprecated" in proc.stdout
