"""README.md's Python examples: every import they show works, as a new user would run it; and the user
docs read as docs for users, with no session history."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


ROOT = README.parent


def _user_docs() -> list[Path]:
    """README.md, docs/*.md and deploy/**/*.md: what a user reads."""
    return [README, *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "deploy").rglob("*.md"))]


def _lines(text: str) -> list[tuple[int, str, bool]]:
    """(line number, text, inside a fenced code block, fence lines included) for every line of a
    markdown text."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), start=1):
        fence = line.lstrip().startswith(("```", "~~~"))
        if fence:
            fenced = not fenced
        out.append((n, line, fenced or fence))
    return out


def _hexlike(token: str) -> bool:
    """A commit-hash-like token: hex digits mixing at least one digit and one letter a-f."""
    return any(c.isdigit() for c in token) and any(c in "abcdef" for c in token)


# What marks a line as session history rather than documentation: each check is (name, pattern,
# whether a match also needs a hex-like group 1, whether it applies to headings only).
_HISTORY_CHECKS: list[tuple[str, re.Pattern[str], bool, bool]] = [
    (
        "issue, session, round or lane number",
        re.compile(r"\b(?:issue|session|round|lane) ?#?\d+", re.I),
        False,
        False,
    ),
    ("lane branch name", re.compile(r"\blane-[a-z0-9]", re.I), False, False),
    ("a run date", re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"), False, False),
    (
        "commit hash",
        re.compile(r"\b(?:commits?|at|on|main|branch)\s+`?([0-9a-f]{7,40})\b", re.I),
        True,
        False,
    ),
    ("commit hash in backticks", re.compile(r"`([0-9a-f]{7,12})`"), True, False),
    ("machine path", re.compile(r"(?<![\w.$}/-])/(?:tmp|work|root|home)/"), False, False),
    ("load average", re.compile(r"\bload (?:average|avg)\b", re.I), False, False),
    ("the lead", re.compile(r"\bthe lead\b", re.I), False, False),
    (
        "heading that narrates before/after",
        re.compile(r"^#+ .*(?:\bbefore\b|\bafter\b|what changed|\bround \d+|\(fixed\))", re.I),
        False,
        True,
    ),
]


def _history_hits(name: str, text_of: dict[str, str]) -> list[str]:
    """Every line of the given documents (name -> markdown text) that one of the checks flags, as
    "file:line: [check] text"."""
    hits = []
    for doc, text in text_of.items():
        for n, line, fenced in _lines(text):
            for check, pattern, needs_hex, headings_only in _HISTORY_CHECKS:
                if check != name or (headings_only and (fenced or not line.startswith("#"))):
                    continue
                if any(not needs_hex or _hexlike(m.group(1)) for m in pattern.finditer(line)):
                    hits.append(f"{doc}:{n}: [{check}] {line.strip()}")
    return hits


@pytest.mark.parametrize("check", [c[0] for c in _HISTORY_CHECKS])
def test_user_docs_carry_no_session_history(check: str) -> None:
    """The user docs say what is, not how it came to be: issue, session, round and lane numbers,
    branch names, run dates, commit hashes, machine paths, load averages, "the lead" and headings that
    narrate a before/after are session history, which belongs in closing notes, not in what a user
    reads. Each failure names the file and line."""
    docs = {str(p.relative_to(ROOT)): p.read_text() for p in _user_docs()}
    hits = _history_hits(check, docs)
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize(
    ("check", "line"),
    [
        ("issue, session, round or lane number", "fixed in issue #13"),
        ("issue, session, round or lane number", "Round 2 of the work"),
        ("lane branch name", "commits on `lane-planner-cpu`"),
        ("a run date", "Measured 2026-11-28 on the VM"),
        ("commit hash", "from commit e4a8ff3, one run"),
        ("commit hash", "main at 79b03b2 and passes now"),
        ("commit hash in backticks", "the frozen copy `0cc969f`"),
        ("machine path", "rfork demo --json /tmp/demo.json"),
        ("machine path", "cwd /work/main"),
        ("load average", "load average 3.4 before, 17.0 after"),
        ("the lead", "The lead re-runs these on a quiet machine"),
        ("heading that narrates before/after", "### Profile before (main)"),
        ("heading that narrates before/after", "### What changed"),
        ("heading that narrates before/after", "## Completion counted before a layer (fixed)"),
    ],
)
def test_each_history_check_catches_what_it_names(check: str, line: str) -> None:
    assert _history_hits(check, {"x.md": line + "\n"}) == [f"x.md:1: [{check}] {line}"]


@pytest.mark.parametrize(
    "line",
    [
        "a `deadbeef` digest, `0123456` and `abcdefab` in backticks are not commits",
        "on 1000000 instances; at 12345678 bytes",
        "RFORK_BENCH_DIR=$PWD/.bench-tmp and /dev/shm/<pid>:0:0",
        "the ordering problem was fixed; a lane of small ops",
        "```\n# before the server starts\n```",
    ],
)
def test_history_checks_leave_ordinary_text_alone(line: str) -> None:
    assert not [h for c in _HISTORY_CHECKS for h in _history_hits(c[0], {"x.md": line + "\n"})]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lstrip("#").strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line, fenced in _lines(path.read_text()):
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        slug = _slug(line)
        k = seen.get(slug, 0)
        seen[slug] = k + 1
        out.add(slug if k == 0 else f"{slug}-{k}")
    return out


def test_every_relative_link_in_the_user_docs_resolves() -> None:
    """Every relative markdown link of README.md, docs/ and deploy/ names a file that exists and, when
    it has one, an anchor that one of that file's headings makes."""
    bad = []
    for doc in _user_docs():
        for n, line, fenced in _lines(doc.read_text()):
            if fenced:
                continue
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):
                    continue  # http:, https:, mailto:
                file_part, _, anchor = target.partition("#")
                dest = (doc.parent / file_part).resolve() if file_part else doc
                if not dest.exists():
                    bad.append(f"{doc.relative_to(ROOT)}:{n}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    bad.append(f"{doc.relative_to(ROOT)}:{n}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


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
