"""docs/architecture.md's count of the files one pull runs through is what scripts/pull_path.py measures."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLAIM = re.compile(
    r"Today: (\d+) files, about ([\d,]+) lines \(rfork (\d+) files, backends (\d+), planner (\d+)\)"
)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_architecture_page_counts_the_files_one_pull_runs_through(tmp_path: Path) -> None:
    claim = CLAIM.search((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert claim is not None, "docs/architecture.md: no 'Today: N files, about M lines (...)' line"
    out = tmp_path / "path.json"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "pull_path.py"), "--json", str(out)],
        check=True,
        capture_output=True,
        timeout=200,
    )
    files: dict[str, int] = json.loads(out.read_text())["files"]
    packages = ("rfork", "backends", "planner")
    per_package = {p: sum(1 for f in files if f.startswith(p + "/")) for p in packages}
    lines = sum(files.values())
    said_files, said_lines, *said_packages = (int(g.replace(",", "")) for g in claim.groups())
    assert (len(files), per_package["rfork"], per_package["backends"], per_package["planner"]) == (
        said_files,
        *said_packages,
    ), f"measured {len(files)} files {per_package}: {sorted(files)}"
    # lines drift with every edit to those files: the page rounds them
    assert abs(lines - said_lines) <= 0.05 * said_lines, f"measured {lines} lines, the page says {said_lines}"
