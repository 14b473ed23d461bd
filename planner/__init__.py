"""The R-Fork planner: which running instance a new instance should pull its weights from.

Public surface (checked by tests/planner/test_public_surface.py): the errors, the wire types and
PlannerClient (the Python client), all from the contract room `planner.contract`; PlannerServer (the
planner in a background thread, for tests and the demo) and the in-process API for embedding the
real planner on a database: Planner (Planner.open(settings)), PlannerSettings, make_policy,
migrate, check_schema, redact_url (a database URL fit to print) and warn_if_world_readable (a secret
file's mode). Every other module is internal.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from planner.contract import (
        AllBusy,
        Anchor,
        Assignment,
        AssignmentRequest,
        AuthError,
        BadRequest,
        Candidate,
        CandidateReason,
        Conflict,
        DigestMismatch,
        HeartbeatAnswer,
        InstancePage,
        InstanceStatus,
        InstanceView,
        Labels,
        ModelsPage,
        ModelView,
        NoSource,
        NotFound,
        PlannerClient,
        PlannerError,
        PlannerUnavailable,
        ProtocolMismatch,
        RankEndpoint,
        RankManifest,
        RankView,
        RegionEntry,
        Registration,
        RegistrationRequest,
        ReportAnswer,
        SourceIdentity,
        StatusChange,
        StoredManifest,
        TensorEntry,
        TransferReport,
        TransfersPage,
        TransferView,
        identity_key,
    )
    from planner.db import check_schema, migrate, redact_url
    from planner.secret_files import warn_if_world_readable
    from planner.selection import make_policy
    from planner.server import PlannerServer
    from planner.service import Planner
    from planner.settings import PlannerSettings, SettingsError


def _surface() -> dict[str, str]:
    """Each public name -> the module it comes from, read from this file's own import lines.

    The `from planner... import` lines above (those under `if TYPE_CHECKING:` load lazily) are the
    one list of the surface: type checkers read them as imports, and `__getattr__`, `__all__` and
    `__dir__` read them here, once, from the source.
    """
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    lazy = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    lines = tree.body + [node for block in lazy for node in block.body]
    return {
        alias.asname or alias.name: node.module
        for node in lines
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == __name__
        for alias in node.names
    }


_WHERE = _surface()
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    """A public name, imported when first used (PEP 562): importing one module of the package pays for
    that module only (a loader imports planner.contract: pydantic, no server)."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
