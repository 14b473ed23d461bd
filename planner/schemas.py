"""Request and response bodies of the REST API (pydantic); every bound here is a 4xx, never a 500."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, field_validator


def _json_int(value: Any) -> Any:
    """JSON Schema's integer: a number with no fraction (5 or 5.0), never a boolean or a string."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be an integer")  # noqa: TRY004 - pydantic turns only ValueError into a 422
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("must be an integer")  # noqa: TRY004 - pydantic turns only ValueError into a 422
        return int(value)
    return value


def _json_number(value: Any) -> Any:
    """JSON Schema's number: never a boolean or a string."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number")  # noqa: TRY004 - pydantic turns only ValueError into a 422
    return value


# placed after a Field's bounds, so the schema keeps them as minimum/maximum
JSON_INT = BeforeValidator(_json_int)
JSON_NUMBER = BeforeValidator(_json_number)

# Text that PostgreSQL can store (no NUL) and that fits its column.
NO_NUL = r"^[^\x00]*$"
Name = Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=NO_NUL)]
Label = Annotated[str, StringConstraints(max_length=256, pattern=NO_NUL)]
ProviderName = Annotated[str, StringConstraints(min_length=1, max_length=32, pattern=r"^[a-z0-9_+-]+$")]
InstanceId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
Rank = Annotated[int, Field(ge=0, le=1_000_000), JSON_INT]
ParallelSize = Annotated[int, Field(ge=1, le=65_536), JSON_INT]
ONE_SIDED = ("tcp", "shm", "efa", "verbs")
# Byte counts, sizes and offsets: at most 2**53 (8 PiB), the largest integer a JSON number carries exactly
# (a larger bound would let a schema-valid value round past it).
MAX_BYTES = 2**53
BASE64 = r"^([A-Za-z0-9+/]{4})*([A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
# A seed's control endpoint: http(s)://host[:port][/], host a name, an IPv4 address (not 0.0.0.0) or
# a bracketed IPv6 address; no credentials, path, query or fragment. The pattern is the whole rule,
# so the OpenAPI schema states exactly what is accepted.
_PORT = r"(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,62})"
_HOST = rf"((?!0\.0\.0\.0(:|/|$)){_LABEL}(\.{_LABEL})*|\[[0-9A-Fa-f:.]{{2,45}}\])"
CONTROL_URL = rf"^https?://{_HOST}(:{_PORT})?/?$"
ControlKey = Annotated[str, StringConstraints(min_length=32, max_length=128, pattern=r"^[0-9a-f]+$")]


class Strict(BaseModel):
    """Unknown fields are refused, so a typo is a 422 naming it instead of silently ignored."""

    model_config = ConfigDict(extra="forbid")


class Status(str, Enum):
    """Instance lifecycle; STALE is set only by the reaper."""

    INITIALIZING = "INITIALIZING"
    LOADING = "LOADING"
    READY = "READY"
    DRAINING = "DRAINING"
    STALE = "STALE"


SettableStatus = Literal["INITIALIZING", "LOADING", "READY", "DRAINING"]


class Identity(Strict):
    """Source identity: two instances are interchangeable iff every field is equal."""

    model: Name
    revision: Name
    fingerprint: Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=NO_NUL)]
    dtype: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=NO_NUL)]
    quantization: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=NO_NUL)]
    tp: ParallelSize
    pp: ParallelSize
    ep: ParallelSize
    dp: ParallelSize
    framework: Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NO_NUL)]
    framework_version: Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NO_NUL)]
    device_kind: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=NO_NUL)]

    def key(self) -> str:
        """sha256 of the canonical JSON (sorted keys, no spaces)."""
        return identity_key(self.model_dump())


def body_conflicts(body: InstanceIn) -> str | None:
    """What a well-formed registration contradicts in itself (409; JSON Schema cannot say it), or None."""
    world = body.identity.tp * body.identity.pp
    seen: set[int] = set()
    for r in body.ranks:
        if r.rank >= world:
            return f"ranks: rank {r.rank} is outside tp*pp = {world}"
        if r.rank in seen:
            return f"ranks: rank {r.rank} is listed twice"
        seen.add(r.rank)
    return None


def manifest_conflicts(manifest: ManifestIn) -> str | None:
    """What a well-formed manifest contradicts in itself (409; JSON Schema cannot say it), or None."""
    sizes = {r.index: r.nbytes for r in manifest.regions}
    if len(sizes) != len(manifest.regions):
        return "regions: index values must be unique"
    for i, t in enumerate(manifest.tensors):
        if t.region not in sizes:
            return f"tensors[{i}].region: no region {t.region}"
        if t.offset + t.nbytes > sizes[t.region]:
            return f"tensors[{i}]: offset+nbytes exceeds region {t.region}'s nbytes"
    return None


def identity_key(identity: dict[str, Any]) -> str:
    """The planner's identity_key of an identity dict."""
    canon = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


class Labels(Strict):
    """Where an instance runs; selection prefers the same node, then rack, then zone."""

    node: Label = ""
    rack: Label = ""
    zone: Label = ""


class RankIn(Strict):
    """One global rank's transport: default provider, engine address (base64) and served backends."""

    rank: Rank
    provider: ProviderName
    address: Annotated[str, StringConstraints(max_length=65_536, pattern=BASE64)]
    backends: Annotated[list[ProviderName], Field(max_length=16)] = []

    @field_validator("address")
    @classmethod
    def _b64(cls, v: str) -> str:
        try:
            base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("address must be base64") from exc
        return v


class InstanceIn(Strict):
    """POST /v1/instances."""

    model_config = ConfigDict(extra="forbid", regex_engine="python-re")  # CONTROL_URL uses a look-ahead

    identity: Identity
    labels: Labels = Labels()
    control_url: Annotated[str, StringConstraints(max_length=2048, pattern=CONTROL_URL)] | None = None
    control_key: ControlKey | None = None  # hex; signs per-assignment control tokens; never shown
    ranks: Annotated[list[RankIn], Field(max_length=65_536)] = []
    max_concurrent_pulls: Annotated[int, Field(ge=1, le=10_000), JSON_INT] = 2


class RankOut(BaseModel):
    """A rank as stored."""

    rank: int
    provider: str
    address: str
    backends: list[str]


class InstanceOut(BaseModel):
    """An instance as the API shows it."""

    id: str
    identity_key: str
    identity: dict[str, Any]
    labels: Labels
    control_url: str | None
    ranks: list[RankOut]
    max_concurrent_pulls: int
    status: Status
    created_at: float
    updated_at: float
    last_heartbeat: float
    quarantined_until: float | None


class Registered(InstanceOut):
    """201 answer to a registration: the instance plus its bearer token (shown once)."""

    token: str


class InstancePage(BaseModel):
    """One page of instances."""

    items: list[InstanceOut]
    total: int


class StatusIn(Strict):
    """POST /v1/instances/{id}/status."""

    status: SettableStatus


class HeartbeatOut(BaseModel):
    """Answer to a heartbeat."""

    status: Status
    ttl_s: float


class RegionIn(BaseModel):
    """One registered memory region of a rank."""

    index: Annotated[int, Field(ge=0, le=1_000_000), JSON_INT]
    nbytes: Annotated[int, Field(ge=0, le=MAX_BYTES), JSON_INT]
    descriptor: Annotated[str, StringConstraints(max_length=1_048_576)]


class TensorIn(BaseModel):
    """One tensor of a rank and where it lives in the regions."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    dtype: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    shape: Annotated[list[Annotated[int, Field(ge=0, le=MAX_BYTES), JSON_INT]], Field(max_length=64)]
    nbytes: Annotated[int, Field(ge=0, le=MAX_BYTES), JSON_INT]
    region: Annotated[int, Field(ge=0, le=1_000_000), JSON_INT]
    offset: Annotated[int, Field(ge=0, le=MAX_BYTES), JSON_INT]
    checksum: Annotated[str, StringConstraints(max_length=1024)]


class ManifestIn(BaseModel):
    """A rank manifest; stored verbatim after this shape check."""

    rank: Rank
    checksum_algorithm: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    regions: list[RegionIn]
    tensors: list[TensorIn]
    # "disk": the publisher loaded these weights from a checkpoint (may anchor the identity's digests);
    # "peer": it pulled them from another instance (never anchors)
    origin: Literal["disk", "peer"] = "peer"


class AssignmentIn(Strict):
    """POST /v1/assignments: who wants which rank, and what it can speak."""

    identity: Identity
    rank: Rank
    labels: Labels = Labels()
    providers: Annotated[list[ProviderName], Field(max_length=16)] = []
    backends: Annotated[list[ProviderName], Field(max_length=16)] = []
    requester_id: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=NO_NUL)] | None = None
    exclude: Annotated[
        list[Annotated[str, StringConstraints(max_length=64, pattern=NO_NUL)]], Field(max_length=1024)
    ] = []
    # the requester's own estimate of loading this rank without a seed (disk, hub), in seconds: when
    # every seed is busy and waiting for one would take longer, the 429 says `fallback: true`
    fallback_s: Annotated[float, Field(gt=0, le=1e7)] | None = None
    # the pull limit this requester will serve at once it is READY (0: it will not serve); the 429
    # estimate counts those future slots for the waiters behind it
    serves_after: Annotated[int, Field(ge=0, le=10_000)] = 0
    # seconds this requester has already waited for this rank (after 429s): it keeps its place in line
    waited_s: Annotated[float, Field(ge=0, le=1e7)] = 0.0


class AnchorOut(BaseModel):
    """The identity's anchored digest set for this rank (planner.integrity.digest_set)."""

    checksum_algorithm: str
    digest_set: str
    instance_id: str


class CandidateOut(BaseModel):
    """One ranked source for a rank (manifest included)."""

    instance_id: str
    rank: int
    provider: str
    address: str
    backends: list[str]
    control_url: str | None
    labels: Labels
    manifest: dict[str, Any]
    anchor: AnchorOut
    control_token: str | None = None  # leased candidate only: present it to its control endpoint



class AssignmentOut(BaseModel):
    """201 answer: the lease (on candidates[0]) and the ranked candidates."""

    id: str
    expires_at: str
    expires_at_unix: float
    candidates: list[CandidateOut]


class ReportIn(Strict):
    """POST /v1/assignments/{id}/report: how the pull went; ends the lease."""

    outcome: Literal["success", "failure"]
    bytes: Annotated[int, Field(ge=0, le=MAX_BYTES), JSON_INT] = 0
    seconds: Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False), JSON_NUMBER] = 0.0
    backend: Annotated[str, StringConstraints(max_length=32, pattern=NO_NUL)] = ""
    reason: Annotated[str, StringConstraints(max_length=1024, pattern=NO_NUL)] | None = None
    error: Annotated[str, StringConstraints(max_length=65_536, pattern=NO_NUL)] | None = None


class ReportOut(BaseModel):
    """Answer to a report."""

    id: str
    outcome: str
    seed_quarantined: bool


class ModelOut(BaseModel):
    """One identity known to the planner."""

    identity_key: str
    identity: dict[str, Any]
    instances: int
    ready: int


class ModelsOut(BaseModel):
    """GET /v1/models."""

    items: list[ModelOut]


class TransferOut(BaseModel):
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


class TransfersOut(BaseModel):
    """GET /v1/transfers."""

    items: list[TransferOut]
    total: int
