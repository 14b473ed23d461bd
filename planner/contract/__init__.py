"""The planner's contract: everything a client of the planner imports, and nothing of the server.

rfork (loader, seed, compile-cache fetch) imports the planner's client side from here only
(tests/test_house.py; the in-process server comes from `planner`). The room holds the wire types
(`wire`: what a loader and a seed exchange with the planner; `views`: what readers get back;
`fields`: their bounds), the errors, `PlannerClient`, the digest set a manifest is anchored by
(`integrity`), the control tokens a seed checks offline (`control_token`) and the one bounded HTTP
exchange with a seed's control endpoint that loaders and the planner's probe use (`seed_http`). It
imports nothing from the server room (SQLAlchemy, FastAPI, uvicorn, settings:
tests/planner/contract/test_room.py). `__all__` is the room's one list (`planner` re-exports it
whole); the errors, control tokens, digest set and network checks (standard library only) load with
the room, the pydantic types and `PlannerClient` (httpx) on first use, so `import planner` stays
light and a module that needs a wire type pays for pydantic and no more.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from planner.contract.control_token import (
    ControlGrant,
    ControlTokenError,
    claimed_rank,
    issue_control_token,
    new_control_key,
    verify_control_token,
)
from planner.contract.errors import (
    AllBusy,
    AuthError,
    BadRequest,
    Conflict,
    DigestMismatch,
    NoSource,
    NotFound,
    PlannerError,
    PlannerUnavailable,
    ProtocolMismatch,
)
from planner.contract.integrity import digest_set, is_cryptographic
from planner.contract.networks import NetworkRefused, inside, parse_networks, resolve_within

if TYPE_CHECKING:  # at run time these load on first use, from the modules `_LAZY` names
    from planner.contract.client import PlannerClient
    from planner.contract.manifest import (
        RankManifest,
        RegionEntry,
        StoredManifest,
        TensorDigest,
        TensorEntry,
        TensorStripes,
    )
    from planner.contract.views import (
        FleetView,
        InstancePage,
        ModelsPage,
        ModelView,
        TransfersPage,
        TransferView,
    )
    from planner.contract.wire import (
        Anchor,
        Assignment,
        AssignmentRequest,
        Candidate,
        CandidateReason,
        CompileCacheSource,
        CompileCacheSources,
        HeartbeatAnswer,
        InstanceStatus,
        InstanceView,
        Labels,
        LeaseRenewal,
        RankEndpoint,
        RankView,
        Registration,
        RegistrationRequest,
        ReportAnswer,
        SourceIdentity,
        StatusChange,
        TransferReport,
        compile_cache_key,
        identity_key,
    )

__all__ = [
    "NetworkRefused",
    "inside",
    "is_cryptographic",
    "parse_networks",
    "resolve_within",
    "AllBusy",
    "Anchor",
    "Assignment",
    "AssignmentRequest",
    "AuthError",
    "BadRequest",
    "Candidate",
    "CandidateReason",
    "CompileCacheSource",
    "CompileCacheSources",
    "Conflict",
    "ControlGrant",
    "ControlTokenError",
    "DigestMismatch",
    "FleetView",
    "HeartbeatAnswer",
    "InstancePage",
    "InstanceStatus",
    "InstanceView",
    "Labels",
    "LeaseRenewal",
    "ModelView",
    "ModelsPage",
    "NoSource",
    "NotFound",
    "PlannerClient",
    "PlannerError",
    "PlannerUnavailable",
    "ProtocolMismatch",
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
    "TensorDigest",
    "TensorEntry",
    "TensorStripes",
    "TransferReport",
    "TransferView",
    "TransfersPage",
    "compile_cache_key",
    "digest_set",
    "identity_key",
    "claimed_rank",
    "issue_control_token",
    "new_control_key",
    "verify_control_token",
]

# Where each lazy name of `__all__` loads from on first use (PEP 562): pydantic costs about a tenth
# of a second, httpx (PlannerClient) a tenth or more.
_LAZY = {
    "planner.contract.client": ("PlannerClient",),
    "planner.contract.manifest": (
        "RankManifest",
        "RegionEntry",
        "StoredManifest",
        "TensorDigest",
        "TensorEntry",
        "TensorStripes",
    ),
    "planner.contract.views": (
        "FleetView",
        "InstancePage",
        "ModelView",
        "ModelsPage",
        "TransferView",
        "TransfersPage",
    ),
    "planner.contract.wire": (
        "Anchor",
        "Assignment",
        "AssignmentRequest",
        "Candidate",
        "CandidateReason",
        "CompileCacheSource",
        "CompileCacheSources",
        "HeartbeatAnswer",
        "InstanceStatus",
        "InstanceView",
        "Labels",
        "LeaseRenewal",
        "RankEndpoint",
        "RankView",
        "Registration",
        "RegistrationRequest",
        "ReportAnswer",
        "SourceIdentity",
        "StatusChange",
        "TransferReport",
        "compile_cache_key",
        "identity_key",
    ),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    """A lazy public name, imported on first use (see `_LAZY`)."""
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'planner.contract' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
