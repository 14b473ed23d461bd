"""The R-Fork planner: which running instance a new instance should pull its weights from.

Public surface (pinned by tests/planner/test_public_surface.py): the errors, the wire types
(planner.wire), PlannerClient (the Python client), PlannerServer (the planner in a background
thread, for tests and the demo) and the in-process API for embedding the real planner on a
database: Planner (Planner.open(settings)), PlannerSettings, make_policy and migrate. Every other
module is internal.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from planner.errors import (
    AllBusy,
    AuthError,
    BadRequest,
    Conflict,
    DigestMismatch,
    NoSource,
    NotFound,
    PlannerError,
    PlannerUnavailable,
)
from planner.wire import (
    Anchor,
    Assignment,
    AssignmentRequest,
    Candidate,
    HeartbeatAnswer,
    InstancePage,
    InstanceStatus,
    InstanceView,
    Labels,
    ModelsPage,
    ModelView,
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

if TYPE_CHECKING:
    from planner.client import PlannerClient
    from planner.db import migrate
    from planner.selection import make_policy
    from planner.server import PlannerServer
    from planner.service import Planner
    from planner.settings import PlannerSettings

# The server side (SQLAlchemy, FastAPI, uvicorn, pydantic-settings: about half a second of imports)
# loads on first use of one of these names, so a loader or seed that imports planner.client or
# planner.wire does not pay for it at start-up.
_SERVER_SIDE = {
    "PlannerClient": "planner.client",
    "Planner": "planner.service",
    "PlannerServer": "planner.server",
    "PlannerSettings": "planner.settings",
    "make_policy": "planner.selection",
    "migrate": "planner.db",
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
    "identity_key",
    "make_policy",
    "migrate",
]


def __getattr__(name: str) -> Any:
    """The server-side names above, imported when first used (PEP 562)."""
    module = _SERVER_SIDE.get(name)
    if module is None:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
