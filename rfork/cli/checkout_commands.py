"""The door to the commands that run from a source checkout: `rfork demo`, `rfork bench`, `rfork simulate`.

Their code is the repository's bench/ folder (the benchmarks, the fleet simulator and the process
harness they share), which the wheel does not ship. `rfork --help` lists them from `WORDS` without
importing bench/; running one finds the checkout this rfork runs from (installed with `pip install -e .`,
as scripts/dev.sh does, or run from the repository root) and imports `bench.commands` from it.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

# the first word of each command that bench/ implements, with the help `rfork --help` shows for it
WORDS = {
    "demo": "cold-start demo: one seed, then instances loaded from disk and by R-Fork (source checkout)",
    "bench": "benchmarks; each measures its baseline in the same run and prints the ratio (source checkout)",
    "simulate": "simulations that drive the real planner on a bandwidth model (source checkout)",
}

Commands = tuple[tuple[tuple[str, ...], ModuleType], ...]


class NoCheckout(RuntimeError):
    """rfork runs from an installed wheel, which holds the product only: bench/ is not there."""


def checkout_root() -> Path | None:
    """The repository root this rfork's files sit in, if it holds bench/; None for a wheel install."""
    root = Path(__file__).resolve().parents[2]
    if (root / "bench" / "commands.py").is_file() and (root / "pyproject.toml").is_file():
        return root
    return None


def load(word: str) -> Commands:
    """The checkout's (command path, module) table for `rfork WORD ...`; NoCheckout from a wheel install."""
    root = checkout_root()
    if root is None:
        raise NoCheckout(
            f"`rfork {word}` runs from a source checkout of rfork (bench/ is not in the wheel): clone the "
            f"repository, run `bash scripts/dev.sh setup` in it, then `rfork {word} ...` there"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # an editable install maps only the packages the wheel ships
    table: Commands = importlib.import_module("bench.commands").COMMANDS
    return table
