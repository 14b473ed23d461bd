"""README.md's Python examples: every import they show works, as a new user would run it; and the user
docs read as docs for users, with no session history."""

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


_SESSION_HISTORY = re.compile(r"\bissue #?\d+|\b[Rr]ound \d+\b", flags=re.I)


def test_user_docs_name_no_issue_numbers_or_rounds() -> None:
    """The user docs say what is, not how it came to be: issue numbers and "round N" of a piece of work
    are session history, which belongs in closing notes, not in what a user reads."""
    root = README.parent
    docs = [README, *sorted((root / "docs").rglob("*.md")), *sorted((root / "deploy").rglob("*.md"))]
    hits = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in docs
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if _SESSION_HISTORY.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_every_metric_the_operations_page_names_is_exported() -> None:
    """docs/operations.md's metrics and alerts name series that rfork and the planner export (an alert
    on a name nobody exports never fires)."""
    from planner.metrics import PlannerMetrics
    from rfork.metrics import REGISTRY

    exported: set[str] = set()
    for registry in (REGISTRY, PlannerMetrics().registry):
        for family in registry.collect():
            exported |= {family.name, *(family.name + s for s in ("_total", "_bucket", "_sum", "_count"))}
    named = set(re.findall(r"\brfork_[a-z_]+", (README.parent / "docs" / "operations.md").read_text()))
    assert named, "no metric found on the page"
    assert named <= exported, sorted(named - exported)
