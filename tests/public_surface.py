"""Checks of a package's public surface, derived from the code and the docs instead of a copied list.

Each package writes its surface once, as its `__init__.py`'s `__all__` (planner's spreads the contract
room's own list); these checks say what that list must agree with: the code it names, the names the
package loads on first use (its `_LAZY` table), its errors and the docs. Each returns the offending
names, empty when fine.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("rfork", "backends", "planner")


def unresolved(package: ModuleType) -> list[str]:
    """Names in `__all__` that do not resolve to the object of that name in the project module that
    defines it (a path of the package resolves to its subpackage), or that `dir()` does not list."""
    bad = []
    for name in package.__all__:
        value = getattr(package, name, None)
        if value is None or name not in dir(package):
            bad.append(name)
        elif inspect.ismodule(value):
            if value.__name__ != f"{package.__name__}.{name}":
                bad.append(name)
        elif inspect.isclass(value) or inspect.isfunction(value):
            home = value.__module__
            if home.split(".")[0] not in PROJECT or getattr(sys.modules[home], name, None) is not value:
                bad.append(name)
    return bad


def lazy_but_unlisted(package: ModuleType) -> list[str]:
    """Names the package loads on first use (its `_LAZY` table: module -> names) that `__all__` does
    not list, or that two modules claim."""
    lazy = [name for names in getattr(package, "_LAZY", {}).values() for name in names]
    twice = {name for name in lazy if lazy.count(name) > 1}
    return sorted((set(lazy) - set(package.__all__)) | twice)


def left_out(package: ModuleType) -> list[str]:
    """The project's own classes, functions and constants the package's namespace holds but does not
    list in `__all__` (read after every public name has been resolved)."""
    for name in package.__all__:
        getattr(package, name)
    return sorted(
        name
        for name, value in vars(package).items()
        if not name.startswith("_")
        and not inspect.ismodule(value)
        and (getattr(value, "__module__", None) or "").split(".")[0] in PROJECT
        and name not in package.__all__
    )


def unexported_errors(package: ModuleType) -> list[str]:
    """Exceptions that the package's `errors` module (`pkg.errors`, or `pkg.contract.errors` where the
    package keeps a contract room) defines but the package does not export."""
    name = package.__name__
    where = f"{name}.contract.errors" if importlib.util.find_spec(f"{name}.contract") else f"{name}.errors"
    errors = importlib.import_module(where)
    return sorted(
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value)
        and issubclass(value, BaseException)
        and value.__module__ == errors.__name__
        and name not in package.__all__
    )


def documented_but_not_public(package: ModuleType) -> list[str]:
    """Names that README.md or docs/*.md import from the package (`from pkg import a, b`) but that its
    `__all__` does not list."""
    pattern = re.compile(rf"^\s*from {re.escape(package.__name__)} import ([\w, ]+)$", re.M)
    shown = {
        name.strip()
        for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for names in pattern.findall(doc.read_text())
        for name in names.split(",")
    }
    return sorted(shown - set(package.__all__))
