"""planner's public surface: `planner.__all__` is pinned (moving a module never breaks a user), every
name resolves, and the client side imports none of the server's stack."""

from __future__ import annotations

import subprocess
import sys

import pytest

import planner

PUBLIC = [
    # errors (planner.errors)
    "AllBusy",
    "AuthError",
    "BadRequest",
    "Conflict",
    "DigestMismatch",
    "NoSource",
    "NotFound",
    "PlannerError",
    "PlannerUnavailable",
    # wire types (planner.wire)
    "Anchor",
    "Assignment",
    "AssignmentRequest",
    "Candidate",
    "HeartbeatAnswer",
    "InstanceStatus",
    "InstanceView",
    "Labels",
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
    "identity_key",
    # reader views (planner.wire)
    "InstancePage",
    "ModelView",
    "ModelsPage",
    "TransferView",
    "TransfersPage",
    # the Python client (planner.client)
    "PlannerClient",
    # the planner in a thread (tests, demo) and embedded on a database (the simulator)
    "PlannerServer",
    "Planner",
    "PlannerSettings",
    "make_policy",
    "migrate",
]


def test_all_is_pinned():
    assert sorted(planner.__all__) == sorted(PUBLIC)
    assert len(set(planner.__all__)) == len(planner.__all__)


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_resolves_to_its_home_module(name: str):
    value = getattr(planner, name)
    module = getattr(value, "__module__", "")
    assert module.startswith("planner.")
    assert getattr(sys.modules[module], name) is value
    assert name in dir(planner)


def test_unknown_names_are_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        planner.Nope  # noqa: B018 - the access is the test


def test_the_client_side_does_not_import_the_server():
    """A loader or seed imports planner.client, planner.wire and planner.control_token; none of them
    may pull in SQLAlchemy, FastAPI, uvicorn or the settings (about half a second of imports)."""
    code = (
        "import sys, planner.client, planner.wire, planner.control_token, planner.integrity, planner.errors\n"
        "heavy = [m for m in ('sqlalchemy', 'fastapi', 'uvicorn', 'starlette', 'pydantic_settings',"
        " 'planner.service', 'planner.app', 'planner.db') if m in sys.modules]\n"
        "print(heavy)\n"
        "from planner import Planner\n"
        "print('sqlalchemy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout + out.stderr
