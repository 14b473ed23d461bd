"""Server-only views of the REST API (pages of instances, models, transfers); the wire types that
clients share live in planner.wire."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from planner.wire import InstanceView


class InstancePage(BaseModel):
    """One page of instances (GET /v1/instances)."""

    items: list[InstanceView]
    total: int


class ModelView(BaseModel):
    """One identity known to the planner, with its instance and READY counts."""

    identity_key: str
    identity: dict[str, Any]
    instances: int
    ready: int


class ModelsPage(BaseModel):
    """GET /v1/models."""

    items: list[ModelView]


class TransferView(BaseModel):
    """One finished (or expired) assignment with its figures."""

    id: str
    seed_id: str
    rank: int
    requester_id: str | None
    identity_key: str
    provider: str
    created_at: float
    ended_at: float | None
    outcome: str | None
    bytes: int | None
    seconds: float | None
    gbps: float | None
    backend: str | None
    reason: str | None
    error: str | None


class TransfersPage(BaseModel):
    """One page of finished assignments (GET /v1/transfers)."""

    items: list[TransferView]
    total: int
