"""The R-Fork planner: which running instance a new instance should pull its weights from.

Public surface (`__all__`, checked by tests/planner/test_public_surface.py): the contract room's own
list, `planner.contract.__all__` (the errors, the wire types, PlannerClient, the client-side helpers);
PlannerServer (the planner in a background thread, for tests and the demo) and the in-process API for
embedding the real planner on a database: Planner (Planner.open(settings)), PlannerSettings,
make_policy, migrate, check_schema, redact_url (a database URL fit to print) and
warn_if_world_readable (a secret file's mode). Every other module is internal.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from planner import contract
from planner.secret_files import warn_if_world_readable

if TYPE_CHECKING:  # at run time these load on first use: the contract's through it, the rest from `_LAZY`
    from planner.contract import *  # noqa: F403 - its own `__all__`, re-exported whole
    from planner.db import check_schema, migrate, redact_url
    from planner.selection import make_policy
    from planner.server import PlannerServer
    from planner.service import Planner
    from planner.settings import PlannerSettings, SettingsError

__all__ = [
    *contract.__all__,
    "Planner",
    "PlannerServer",
    "PlannerSettings",
    "SettingsError",
    "check_schema",
    "make_policy",
    "migrate",
    "redact_url",
    "warn_if_world_readable",
]

# Where each server-side name loads from on first use (PEP 562): `import planner` (`rfork --help`
# imports planner.selection) loads no pydantic, and a loader no SQLAlchemy, FastAPI or uvicorn.
_LAZY = {
    "planner.db": ("check_schema", "migrate", "redact_url"),
    "planner.selection": ("make_policy",),
    "planner.server": ("PlannerServer",),
    "planner.service": ("Planner",),
    "planner.settings": ("PlannerSettings", "SettingsError"),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    """A public name, imported when first used: the contract's through the contract (which loads its
    pydantic types and PlannerClient on first use), the server side's from its module."""
    if name in contract.__all__:
        value = getattr(contract, name)
    elif name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    else:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
