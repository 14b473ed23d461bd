"""The planner's wire types (docs/contracts.md), one definition for the server and its Python clients.

Pydantic models only: no FastAPI, no SQLAlchemy, so a loader or seed can import them without the
server. Every bound here is a 4xx on the server, never a 500 (the bounds: planner.contract.fields).
Requests refuse unknown fields (a typo is a 422 naming it); a rank manifest keeps them (it is stored
verbatim). What readers get back (pages, the fleet page) is in planner.contract.views.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StringConstraints,
    field_validator,
)

from planner.contract.fields import (
    BASE64,
    CONTROL_URL,
    JSON_INT,
    JSON_NUMBER,
    MAX_BYTES,
    NO_NUL,
    ArchiveDigest,
    Bytes,
    CompileCacheKey,
    CompileCacheVariant,
    ControlKey,
    IdentityKey,
    Label,
    Name,
    ParallelSize,
    ProviderName,
    Rank,
    Strict,
    Text64,
    Text128,
    Text256,
    b64decode,
)
from planner.contract.manifest import (
    ManifestOrStored,
    RankManifest,
    StoredManifest,
    TensorDigest,
)


def identity_key(identity: Mapping[str, Any]) -> str:
    """The planner's identity_key: sha256 (hex) of the canonical JSON (sorted keys, no spaces)."""
    canon = json.dumps(dict(identity), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def compile_cache_key(identity_key: str, variant: str) -> str:
    """A compile-cache key: sha256 (hex) of the identity key and the key's variant (the sha256 of
    everything else a compiled artifact depends on: rfork.compile_cache.key.CompileCacheKey.variant).

    Bound to its identity so the planner checks, from the variant alone, which identity a key belongs
    to: an authority of one identity can never anchor another identity's key."""
    return hashlib.sha256(f"rfork-compile-cache\0{identity_key}\0{variant}".encode()).hexdigest()




# ---- identity, labels, ranks ------------------------------------------------------------------


class SourceIdentity(Strict):
    """Source identity: two instances are interchangeable iff every field is equal.

    On the wire every field is required (docs/contracts.md); constructed in Python, quantization,
    tp/pp/ep/dp, framework, framework_version and device_kind have defaults. Frozen, so hashable.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Name
    revision: Name
    fingerprint: Text256
    dtype: Text64
    quantization: Text64
    tp: ParallelSize
    pp: ParallelSize
    ep: ParallelSize
    dp: ParallelSize
    framework: Text128
    framework_version: Text128
    device_kind: Text64

    def __init__(
        self,
        *,
        model: str,
        revision: str,
        fingerprint: str,
        dtype: str,
        quantization: str = "none",
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        dp: int = 1,
        framework: str = "rfork",
        framework_version: str = "0",
        device_kind: str = "cpu",
    ) -> None:
        fields = {
            "model": model,
            "revision": revision,
            "fingerprint": fingerprint,
            "dtype": dtype,
            "quantization": quantization,
            "tp": tp,
            "pp": pp,
            "ep": ep,
            "dp": dp,
            "framework": framework,
            "framework_version": framework_version,
            "device_kind": device_kind,
        }
        super().__init__(**fields)

    # Pydantic calls a model's own __init__ when it validates data (model_validate, FastAPI bodies),
    # which would give JSON these defaults; this marker says the __init__ above only forwards to
    # validation (as BaseModel.__init__ does), so data is validated as given: every field required.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @property
    def world_size(self) -> int:
        """Ranks that hold weights: tp * pp (global rank = pp_rank * tp + tp_rank)."""
        return self.tp * self.pp

    def key(self) -> str:
        """The planner's identity_key of this identity."""
        return identity_key(self.model_dump())


class Labels(Strict):
    """Where an instance runs; selection prefers the same node, then rack, then zone."""

    node: Label = ""
    rack: Label = ""
    zone: Label = ""


class RankEndpoint(Strict):
    """One global rank's transport as a seed registers it: default provider, engine address (base64)
    and the backends it serves (one-sided provider names and/or nccl; empty: the provider alone)."""

    rank: Rank
    provider: ProviderName
    address: Annotated[str, StringConstraints(max_length=65_536, pattern=BASE64)]
    backends: Annotated[list[ProviderName], Field(max_length=16)] = []

    @field_validator("address")
    @classmethod
    def _b64(cls, v: str) -> str:
        b64decode(v, "address")
        return v

    def address_bytes(self) -> bytes:
        """The engine address (base64 on the wire)."""
        return b64decode(self.address, "address")


# ---- instances --------------------------------------------------------------------------------


class InstanceStatus(str, Enum):
    """Instance lifecycle; STALE is set only by the reaper."""

    INITIALIZING = "INITIALIZING"
    LOADING = "LOADING"
    READY = "READY"
    DRAINING = "DRAINING"
    STALE = "STALE"


SettableStatus = Literal["INITIALIZING", "LOADING", "READY", "DRAINING"]


class RegistrationRequest(Strict):
    """POST /v1/instances."""

    model_config = ConfigDict(extra="forbid", regex_engine="python-re")  # CONTROL_URL uses a look-ahead

    identity: SourceIdentity
    labels: Labels = Labels()
    control_url: Annotated[str, StringConstraints(max_length=2048, pattern=CONTROL_URL)] | None = None
    control_key: ControlKey | None = Field(default=None, repr=False)  # hex; signs control tokens; never shown
    ranks: Annotated[list[RankEndpoint], Field(max_length=65_536)] = []
    max_concurrent_pulls: Annotated[int, Field(ge=1, le=10_000), JSON_INT] = 2
    # compile caches its control endpoint serves (GET /v1/compile-caches/{key}); needs a control_url
    compile_cache_keys: Annotated[list[CompileCacheKey], Field(max_length=64)] = []

    def conflicts(self) -> str | None:
        """What a well-formed registration contradicts in itself (409; JSON Schema cannot say it), or None."""
        world = self.identity.world_size
        seen: set[int] = set()
        for r in self.ranks:
            if r.rank >= world:
                return f"ranks: rank {r.rank} is outside tp*pp = {world}"
            if r.rank in seen:
                return f"ranks: rank {r.rank} is listed twice"
            seen.add(r.rank)
        if self.compile_cache_keys and (self.control_url is None or self.control_key is None):
            return "compile_cache_keys: serving compile caches needs a control_url and a control_key"
        if len(set(self.compile_cache_keys)) != len(self.compile_cache_keys):
            return "compile_cache_keys: a key is listed twice"
        return None


class RankView(BaseModel):
    """A rank as stored (backends filled in: the provider alone when none were registered)."""

    rank: int
    provider: str
    address: str
    backends: list[str]


class InstanceView(BaseModel):
    """An instance as the API shows it (never its control_key)."""

    id: str
    identity_key: str
    identity: dict[str, Any]
    labels: Labels
    control_url: str | None
    ranks: list[RankView]
    max_concurrent_pulls: int
    status: InstanceStatus
    created_at: float
    updated_at: float
    last_heartbeat: float
    quarantined_until: float | None
    # a checksum mismatch was reported: offered to nobody until it re-hashed its memory and republished
    reverifying: bool = False
    # its manifest differed from the anchor: offered to nobody until it republishes clean
    integrity_failed: bool = False
    # a checksum report stands against it: probation pulls only, until another loader's pull verifies
    accused: bool = False
    compile_cache_keys: list[str] = []


class Registration(InstanceView):
    """201 answer to a registration: the instance plus its bearer token (shown once, never in repr)."""

    token: str = Field(repr=False)
    # the key the seed's control endpoint checks per-assignment tokens with (derived from the planner's
    # secret, planner.contract.control_token; shown once, never stored); None without a control_url
    control_key: str | None = Field(default=None, repr=False)


class StatusChange(Strict):
    """POST /v1/instances/{id}/status."""

    status: SettableStatus


class HeartbeatAnswer(BaseModel):
    """Answer to a heartbeat: the instance's status and how long until it turns STALE without one."""

    status: InstanceStatus
    ttl_s: float
    # a loader reported a checksum mismatch: re-hash the memory and republish the manifests (until then
    # the planner offers this instance to nobody)
    reverify: bool = False


# ---- assignments ------------------------------------------------------------------------------


class AssignmentRequest(Strict):
    """POST /v1/assignments: who wants which rank, and what it can speak."""

    identity: SourceIdentity
    rank: Rank
    labels: Labels = Labels()
    providers: Annotated[list[ProviderName], Field(max_length=16)] = []
    backends: Annotated[list[ProviderName], Field(max_length=16)] = []
    requester_id: Text64 | None = None
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


class Anchor(BaseModel):
    """The identity's anchored digest set for a rank (planner.contract.integrity.digest_set) and who
    anchored it."""

    checksum_algorithm: str
    digest_set: str
    instance_id: str


class CandidateReason(BaseModel):
    """Why a candidate has its place in the answer (planner.selection.rank_reason): what the policy
    ranked it by, so a loader can say why it pulls from where it does."""

    policy: str  # the selection policy that ranked it (load_aware, random, rendezvous)
    tier: Literal["node", "rack", "zone", "elsewhere"]  # topology distance from the requester
    active_leases: int  # its live pulls of this rank when the decision was made (this lease not counted)
    max_concurrent_pulls: int
    rack_hold: bool = False  # the rack-hold rule applied: this requester's rack holds seeds it must wait for
    summary: str  # one line for logs, e.g. "same rack, 0/2 pulls busy: nearest tier, least loaded"


class Candidate(BaseModel):
    """One ranked source for a rank: where to pull from, how, and what (its manifest)."""

    instance_id: str
    rank: int
    provider: str
    address: str
    backends: list[str]
    control_url: str | None
    labels: Labels
    anchor: Anchor
    # leased candidate only: present it to its control endpoint
    control_token: str | None = Field(default=None, repr=False)
    # why it is ranked where it is; None from a planner before the field (older clients ignore it)
    reason: CandidateReason | None = None
    manifest: Annotated[RankManifest | StoredManifest, ManifestOrStored] = Field(repr=False)

    def address_bytes(self) -> bytes:
        """The seed rank's engine address (base64 on the wire)."""
        return b64decode(self.address, "address")

    def rank_manifest(self) -> RankManifest:
        """The manifest, parsed (the server holds it as stored text)."""
        m = self.manifest
        return m.parse() if isinstance(m, StoredManifest) else m


class Assignment(BaseModel):
    """201 answer: a lease on candidates[0] until expires_at; the others are unleased alternatives."""

    id: str
    expires_at: str  # ISO 8601, UTC
    expires_at_unix: float
    candidates: list[Candidate]


class CompileCacheRequest(Strict):
    """POST /v1/compile-caches/{key}/sources: the identity whose key the requester asks for (only READY
    instances of that identity are offered, and only when the key's anchor is that identity's), and
    its labels (nearest sources first)."""

    identity_key: IdentityKey
    labels: Labels = Labels()
    # sources the requester already tried (and reported): the answer replaces them with others
    exclude: Annotated[
        list[Annotated[str, StringConstraints(max_length=64, pattern=NO_NUL)]], Field(max_length=256)
    ] = []


class CompileCacheSource(BaseModel):
    """A READY instance whose control endpoint serves a compile cache, with a token for one fetch."""

    instance_id: str
    control_url: str
    labels: Labels
    # planner.contract.control_token for GET {control_url}/v1/compile-caches/{key}; opens no weight session
    control_token: str = Field(repr=False)


class CompileCacheSources(BaseModel):
    """Answer to POST /v1/compile-caches/{key}/sources: who serves that key, nearest first, and the digest
    an authority anchored for it (the only archive a loader installs; never the seed's own claim)."""

    cache_key: str
    archive_digest: str
    sources: list[CompileCacheSource]


class CompileCacheReport(Strict):
    """POST /v1/compile-caches/{key}/reports: how a fetch from one source went. `verified`: its archive
    had the anchored digest and was installed; `failed`: anything else (refused, wrong bytes, deadline).
    Sources are ranked by these reports: served and verified before first, failed last."""

    instance_id: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=NO_NUL)]
    outcome: Literal["verified", "failed"]
    error: Annotated[str, StringConstraints(max_length=1024, pattern=NO_NUL)] | None = None


class CompileCacheAnchorUpload(Strict):
    """PUT /v1/compile-caches/{key}/anchor: the archive digest the key must have.

    The first authority wins: an admin (naming the identity whose instances may serve the key), or an
    instance registered with the anchor role, for a key it serves and its own identity. The same digest
    again is a no-op, another one a 409, unless an admin sets `replace`.
    """

    archive_digest: ArchiveDigest
    # the key's variant (compile_cache_key): the planner derives the key from the identity and this, and
    # refuses a key that is not the identity's
    key_variant: CompileCacheVariant
    identity_key: IdentityKey | None = None  # an admin's upload needs it; an instance's is its own
    replace: StrictBool = False  # admin only: replace an anchored digest


class TransferReport(Strict):
    """POST /v1/assignments/{id}/report: how the pull went; ends the lease."""

    outcome: Literal["success", "failure"]
    bytes: Annotated[int, Field(ge=0, le=MAX_BYTES), JSON_INT] = 0
    seconds: Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False), JSON_NUMBER] = 0.0
    backend: Annotated[str, StringConstraints(max_length=32, pattern=NO_NUL)] = ""
    reason: Annotated[str, StringConstraints(max_length=1024, pattern=NO_NUL)] | None = None
    error: Annotated[str, StringConstraints(max_length=65_536, pattern=NO_NUL)] | None = None


class LeaseRenewal(BaseModel):
    """Answer to POST /v1/assignments/{id}/renew: the lease's new expiry (a long pull keeps its slot)."""

    id: str
    expires_at_unix: float


class AnchorUpload(Strict):
    """PUT /v1/anchors (admin): an identity's rank digests, e.g. the file `rfork digest CHECKPOINT` writes."""

    identity: SourceIdentity
    rank: Rank
    checksum_algorithm: Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NO_NUL)]
    # tensor name -> checksum, with dtype, shape and nbytes per tensor where the digest set needs them
    tensors: Annotated[list[TensorDigest], Field(min_length=1, max_length=1_000_000)]


class ReportAnswer(BaseModel):
    """Answer to a report."""

    id: str
    outcome: str
    seed_quarantined: bool


# ---- what a loader tells the fleet page during a pull (GET /v1/fleet, /ui) -------------------


class ProgressReport(Strict):
    """POST /v1/assignments/{id}/progress: bytes read so far of a live pull (its holder only)."""

    bytes_done: Bytes
    bytes_total: Bytes


class SeededReport(Strict):
    """POST /v1/assignments/{id}/seeded: the instance now serving what this pull read (its holder only).

    Links a loader's pull to the seed it became, so the fan-out tree can chain seed -> loader -> loader.
    """

    instance_id: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
