"""What readers get back: pages of instances, models and transfers, anchors, and the fleet page.

Answers only (the server builds them, operators, dashboards and `rfork load --checkpoint-id` read
them); the bodies a loader and a seed exchange with the planner are in planner.contract.wire.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from planner.contract.wire import InstanceStatus, InstanceView, Labels, SourceIdentity


class AnchorView(BaseModel):
    """An identity's anchored digest set for one rank and algorithm, and who set it."""

    identity_key: str
    rank: int
    checksum_algorithm: str
    digest_set: str
    tensors: int
    instance_id: str
    set_by: str
    created_at: float


class CompileCacheAnchorView(BaseModel):
    """A compile-cache key's anchored archive digest, the identity that may serve it, and who set it."""

    cache_key: str
    identity_key: str
    archive_digest: str
    instance_id: str
    set_by: str
    created_at: float


class AnchorsPage(BaseModel):
    """GET /v1/anchors (admin)."""

    items: list[AnchorView]
    total: int


class SharedIdentity(BaseModel):
    """An identity whose anchor shares tensors with the asked one's (equal name and digest): what a
    rollout reads those tensors from when the asked identity has few seeds."""

    identity: SourceIdentity
    identity_key: str
    shared_tensors: int = Field(description="tensors whose name and anchored digest equal the asked one's")
    ready: int = Field(description="READY instances of this identity")


class SharedPage(BaseModel):
    """GET /v1/identities/{identity_key}/shared: most shared tensors first."""

    items: list[SharedIdentity]


# ---- views for readers (operators, dashboards, `rfork load --checkpoint-id`) -----------------


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


# ---- the fleet page (GET /v1/fleet, /ui) -------------------------------------------------------


class FleetAnchor(BaseModel):
    """An identity's anchored digest set for one rank (short digest) and the instance that anchored it."""

    rank: int
    checksum_algorithm: str
    cryptographic: bool  # whether the algorithm resists a crafted collision (blake3), not only accidents
    digest_set: str
    anchored_by: str


class FleetIdentity(BaseModel):
    """An identity as the page shows it: names, layout and anchor state (no fingerprint, no digests)."""

    identity_key: str
    model: str
    revision: str
    framework: str
    dtype: str
    layout: str  # e.g. "tp2 pp1 ep1 dp1"
    ranks: int
    anchors: list[FleetAnchor]


class FleetInstance(BaseModel):
    """An instance without its addresses, control endpoint or descriptors."""

    id: str
    identity_key: str
    status: InstanceStatus
    labels: Labels
    pulls: int  # live leases it serves
    max_concurrent_pulls: int
    heartbeat_age_s: float
    quarantined_for_s: float | None  # seconds left; None when not quarantined
    quarantine_reason: str | None  # the reason of its latest failed pull, while quarantined
    # a checksum report stands against it: served only to probation pulls until one verifies
    accused: bool = False


class FleetEdge(BaseModel):
    """One pull in the fan-out tree: seed -> loader (loader_id once the loader serves what it read)."""

    assignment_id: str
    seed_id: str
    loader_id: str | None
    rank: int
    transport: str
    started_at: float
    live: bool
    bytes_done: int
    bytes_total: int | None
    gbps: float | None
    outcome: str | None


class FleetTransfer(BaseModel):
    """A finished pull: figures and the verdict (verified, or the failure reason)."""

    assignment_id: str
    seed_id: str
    loader_id: str | None
    rank: int
    transport: str
    ended_at: float
    seconds: float | None
    bytes: int | None
    gbps: float | None
    outcome: str
    reason: str | None


class Refusal(BaseModel):
    """A request the planner turned down: no source, all busy (429), a digest mismatch."""

    at: float
    identity_key: str
    rank: int
    reason: str
    detail: str


class FlaggedReporter(BaseModel):
    """A reporter whose checksum claims independent verifications disproved false_report_threshold times
    or more: its checksum reports are ignored. `reporter` is `instance:<id>`, or `token:<hash>/<requester_id>`
    for a static token's caller that named itself."""

    reporter: str
    disproved: int


class FleetView(BaseModel):
    """GET /v1/fleet: everything the fleet page draws, for the reader role."""

    now: float
    identities: list[FleetIdentity]
    instances: list[FleetInstance]
    edges: list[FleetEdge]
    transfers: list[FleetTransfer]
    refusals: list[Refusal]
    flagged_reporters: list[FlaggedReporter] = Field(default_factory=list)
