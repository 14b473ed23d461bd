"""The R-Fork planner: which running instance a new instance should pull its weights from.

Public surface (pinned by tests/planner/test_public_surface.py): the errors, the wire types and
PlannerClient (the Python client), all from the contract room `planner.contract`; PlannerServer (the
planner in a background thread, for tests and the demo) and the in-process API for embedding the
real planner on a database: Planner (Planner.open(settings)), PlannerSettings, make_policy,
migrate and check_schema. Every other module is internal.
"""

from __future__ import annotations

import importlib
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
    from planner.db import check_schema, migrate
    from planner.selection import make_policy
    from planner.server import PlannerServer
    from planner.service import Planner
    from planner.settings import PlannerSettings

# Every name loads on first use (PEP 562), so importing one module of the package pays for that module
# only: `rfork --help` lists the selection policies (planner.selection, stdlib only), a loader or seed
# imports planner.contract (pydantic, no server), and the server side (SQLAlchemy, FastAPI, uvicorn,
# pydantic-settings: about half a second of imports) loads when one of these names is used.
_SERVER_SIDE = {
    "Planner": "planner.service",
    "PlannerServer": "planner.server",
    "PlannerSettings": "planner.settings",
    "make_policy": "planner.selection",
    "migrate": "planner.db",
    "check_schema": "planner.db",
}

__all__ = [
    "AllBusy",
    "Anchor",
    "Assignment",
    "AssignmentRequest",
    "AuthError",
    "BadRequest",
    "Candidate",
    "Conflict",
    "DigestMismatch",
    "HeartbeatAnswer",
    "InstancePage",
    "InstanceStatus",
    "InstanceView",
    "Labels",
    "ModelView",
    "ModelsPage",
    "NoSource",
    "NotFound",
    "Planner",
    "PlannerClient",
    "PlannerError",
    "PlannerServer",
    "PlannerSettings",
    "PlannerUnavailable",
    "RankEndpoint",
    "RankManifest",
    "RankView",
    "RegionEntry",
    "Registration",
    "RegistrationRequest",
    "ReportAnswer",
    "SourceIdentity",
    "StatusChange",
    "StoredManifest",
    "TensorEntry",
    "TransferReport",
    "TransferView",
    "TransfersPage",
    "check_schema",
    "identity_key",
    "make_policy",
    "migrate",
]


def __getattr__(name: str) -> Any:
    """A public name, imported when first used: the server side's from its module, the rest from
    planner.contract."""
    if name not in __all__:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    value = getattr(importlib.import_module(_SERVER_SIDE.get(name, "planner.contract")), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
