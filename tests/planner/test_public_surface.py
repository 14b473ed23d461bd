"""planner's public surface: `planner.__all__` is pinned (moving a module never breaks a user) and every
name resolves. That the client side imports none of the server: tests/planner/contract/test_room.py."""

from __future__ import annotations

import sys

import pytest

import planner

PUBLIC = [
    # errors (planner.contract.errors)
    "AllBusy",
    "AuthError",
    "BadRequest",
    "Conflict",
    "DigestMismatch",
    "NoSource",
    "NotFound",
    "PlannerError",
    "PlannerUnavailable",
    # wire types (planner.contract.wire)
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
    # reader views (planner.contract.wire)
    "InstancePage",
    "ModelView",
    "ModelsPage",
    "TransferView",
    "TransfersPage",
    # the Python client (planner.contract.client)
    "PlannerClient",
    # the planner in a thread (tests, demo) and embedded on a database (the simulator)
    "PlannerServer",
    "Planner",
    "PlannerSettings",
    "make_policy",
    "migrate",
    "check_schema",
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

