"""The planner's wire types (docs/contracts.md), one definition for the server and its Python clients.

Pydantic models only: no FastAPI, no SQLAlchemy, so a loader or seed can import them without the
server. Every bound here is a 4xx on the server, never a 500. Requests refuse unknown fields (a typo
is a 422 naming it); a rank manifest keeps them (it is stored verbatim).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
from collections.abc import Mapping
from enum import Enum
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    PrivateAttr,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    StringConstraints,
    field_validator,
)
from pydantic_core import CoreSchema, core_schema


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
Rank = Annotated[int, Field(ge=0, le=1_000_000), JSON_INT]
ParallelSize = Annotated[int, Field(ge=1, le=65_536), JSON_INT]
# Byte counts, sizes and offsets: at most 2**53 (8 PiB), the largest integer a JSON number carries exactly
# (a larger bound would let a schema-valid value round past it).
MAX_BYTES = 2**53
Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES), JSON_INT]
RegionIndex = Annotated[int, Field(ge=0, le=1_000_000), JSON_INT]
BASE64 = r"^([A-Za-z0-9+/]{4})*([A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
# A seed's control endpoint: http(s)://host[:port][/], host a name, an IPv4 address (not 0.0.0.0) or
# a bracketed IPv6 address; no credentials, path, query or fragment. The pattern is the whole rule,
# so the OpenAPI schema states exactly what is accepted.
_PORT = r"(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,62})"
_HOST = rf"((?!0\.0\.0\.0(:|/|$)){_LABEL}(\.{_LABEL})*|\[[0-9A-Fa-f:.]{{2,45}}\])"
CONTROL_URL = rf"^https?://{_HOST}(:{_PORT})?/?$"
# non-empty text without NUL, at most N characters
Text64 = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=NO_NUL)]
Text128 = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NO_NUL)]
Text256 = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=NO_NUL)]
ControlKey = Annotated[str, StringConstraints(min_length=32, max_length=128, pattern=r"^[0-9a-f]+$")]
# rfork.compile_cache.key.CompileCacheKey.digest(): sha256 of what a compiled artifact depends on
CompileCacheKey = Annotated[str, StringConstraints(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")]


def identity_key(identity: Mapping[str, Any]) -> str:
    """The planner's identity_key: sha256 (hex) of the canonical JSON (sorted keys, no spaces)."""
    canon = json.dumps(dict(identity), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def _b64decode(value: str, what: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{what} must be base64") from exc


class Strict(BaseModel):
    """Unknown fields are refused, so a typo is a 422 naming it instead of silently ignored."""

    model_config = ConfigDict(extra="forbid")


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
        _b64decode(v, "address")
        return v

    def address_bytes(self) -> bytes:
        """The engine address (base64 on the wire)."""
        return _b64decode(self.address, "address")


# ---- rank manifests ---------------------------------------------------------------------------


class RegionEntry(BaseModel):
    """One registered memory region of a rank."""

    index: RegionIndex
    nbytes: Bytes
    descriptor: Annotated[str, StringConstraints(max_length=1_048_576)]

    def descriptor_bytes(self) -> bytes:
        """MemoryRegionDescriptor.to_bytes() (base64 on the wire; "" where the reader may not see it)."""
        return _b64decode(self.descriptor, f"regions[index={self.index}].descriptor")


class TensorEntry(BaseModel):
    """One tensor of a rank and where it lives in the regions."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    dtype: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    shape: Annotated[list[Annotated[int, Field(ge=0, le=MAX_BYTES), JSON_INT]], Field(max_length=64)]
    nbytes: Bytes
    region: RegionIndex
    offset: Bytes
    checksum: Annotated[str, StringConstraints(max_length=1024)]


class TensorDigest(Strict):
    """One tensor of an anchor upload: what the digest set covers (planner.integrity.digest_set)."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=NO_NUL)]
    dtype: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=NO_NUL)]
    shape: Annotated[list[Annotated[int, Field(ge=0, le=MAX_BYTES), JSON_INT]], Field(max_length=64)]
    nbytes: Bytes
    checksum: Annotated[str, StringConstraints(max_length=1024, pattern=NO_NUL)]


# Bytes per element of each dtype name a manifest may carry: torch's names (a "torch." prefix is
# allowed), here so that checking a manifest needs no torch.
DTYPE_BYTES: dict[str, int] = {
    **dict.fromkeys(("complex128", "cdouble"), 16),
    **dict.fromkeys(("float64", "double", "int64", "long", "uint64", "complex64", "cfloat"), 8),
    **dict.fromkeys(("float32", "float", "int32", "int", "uint32", "qint32", "complex32", "chalf"), 4),
    **dict.fromkeys(("bfloat16", "float16", "half", "int16", "short", "uint16", "bits16"), 2),
    **dict.fromkeys(
        ("bool", "int8", "uint8", "qint8", "quint8", "quint4x2", "quint2x4", "bits8", "bits1x8", "bits2x4",
         "bits4x2", "bit", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
         "float8_e8m0fnu", "float4_e2m1fn_x2", *(f"int{b}" for b in range(1, 8)),
         *(f"uint{b}" for b in range(1, 8))),
        1,
    ),
}


class RankManifest(BaseModel):
    """A rank manifest: which regions a rank serves and where each tensor lies in them.

    The planner checks this shape and `conflicts()`, then stores the text verbatim (unknown fields
    included). A loader calls `check()` once where it receives one; after that the manifest is
    trusted as it is, and its descriptors are read decoded (`descriptor`).
    """

    rank: Rank
    checksum_algorithm: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    regions: list[RegionEntry]
    tensors: list[TensorEntry]
    # "disk": the publisher loaded these weights from a checkpoint (may anchor the identity's digests);
    # "peer": it pulled them from another instance (never anchors)
    origin: Literal["disk", "peer"] = "peer"
    _descriptors: dict[int, bytes] | None = PrivateAttr(default=None)  # set by check()

    def conflicts(self) -> str | None:
        """What a well-formed manifest contradicts in itself (409; JSON Schema cannot say it), or None."""
        sizes = {r.index: r.nbytes for r in self.regions}
        if len(sizes) != len(self.regions):
            return "regions: index values must be unique"
        for i, t in enumerate(self.tensors):
            if t.region not in sizes:
                return f"tensors[{i}].region: no region {t.region}"
            if t.offset + t.nbytes > sizes[t.region]:
                return f"tensors[{i}]: offset+nbytes exceeds region {t.region}'s nbytes"
        return self._oversized_region()

    def _oversized_region(self) -> str | None:
        """A region larger than the tensors in it (a loader would allocate and read the excess), or None."""
        covered = self.covered_region_bytes()
        for r in self.regions:
            if r.nbytes > covered.get(r.index, 0):
                return (
                    f"regions: region {r.index} has nbytes {r.nbytes} but its tensors end at "
                    f"{covered.get(r.index, 0)}"
                )
        return None

    def check(self) -> None:
        """Every invariant a reader relies on, in one place; ValueError naming the first region or
        tensor that does not add up. Decodes each region's descriptor (once: `descriptor` reads it).

        Regions: unique indices, base64 descriptors, no larger than their tensors. Tensors: unique
        names, a known dtype whose size times the shape is `nbytes`, bytes inside their region (a
        zero-byte tensor has none: its region is not looked at).
        """
        decoded: dict[int, bytes] = {}
        for r in self.regions:
            if r.index in decoded:
                raise ValueError(f"duplicate region index {r.index}")
            decoded[r.index] = r.descriptor_bytes()
        sizes = {r.index: r.nbytes for r in self.regions}
        names: set[str] = set()
        for t in self.tensors:
            if t.name in names:
                raise ValueError(f"duplicate tensor {t.name!r}")
            names.add(t.name)
            size = DTYPE_BYTES.get(t.dtype.removeprefix("torch."))
            if size is None:
                raise ValueError(f"tensor {t.name!r}: unknown dtype {t.dtype!r}")
            want = size * math.prod(t.shape)
            if t.nbytes != want:
                raise ValueError(
                    f"tensor {t.name!r}: nbytes {t.nbytes} != {want} for {t.dtype}{list(t.shape)}"
                )
            if t.nbytes == 0:
                continue
            if t.region not in sizes:
                raise ValueError(f"tensor {t.name!r} names missing region {t.region}")
            if t.offset + t.nbytes > sizes[t.region]:
                raise ValueError(
                    f"tensor {t.name!r} [{t.offset}, +{t.nbytes}) overruns region {t.region} "
                    f"({sizes[t.region]} bytes)"
                )
        oversized = self._oversized_region()
        if oversized is not None:
            raise ValueError(oversized)
        self._descriptors = decoded

    def descriptor(self, index: int) -> bytes:
        """Region `index`'s descriptor as `check()` decoded it (MemoryRegionDescriptor.to_bytes())."""
        if self._descriptors is None:
            raise RuntimeError("RankManifest.descriptor: check() the manifest first")
        return self._descriptors[index]

    def covered_region_bytes(self) -> dict[int, int]:
        """{region index: where its last tensor ends}: the only region sizes a loader allocates."""
        ends: dict[int, int] = {}
        for t in self.tensors:
            if t.nbytes:
                ends[t.region] = max(ends.get(t.region, 0), t.offset + t.nbytes)
        return ends

    @property
    def region_bytes(self) -> int:
        """Bytes of every region together: what a pull of this rank moves."""
        return sum(r.nbytes for r in self.regions)


class StoredManifest:
    """A rank manifest's JSON text as the planner stored it (checked when it was published).

    An assignment carries it as-is: manifests go up to 32 MiB, and parsing one per candidate per
    answer would cost more than the rest of the request. `dump_json` embeds the text unparsed.
    """

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"StoredManifest({len(self.text)} characters)"

    def parse(self) -> RankManifest:
        """The manifest as a RankManifest."""
        return RankManifest.model_validate_json(self.text)


def _stored_manifest_json(value: Any, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
    if not isinstance(value, StoredManifest):
        return handler(value)
    # Python mode keeps the object (dump_json embeds its text); JSON mode has no raw-text escape hatch
    return value if info.mode == "python" else json.loads(value.text)


class _ManifestOrStored:
    """Schema of Candidate.manifest: JSON gives a RankManifest; the server may put a StoredManifest."""

    @classmethod
    def __get_pydantic_core_schema__(cls, _source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        parsed = handler.generate_schema(RankManifest)
        return core_schema.json_or_python_schema(
            json_schema=parsed,  # and so the JSON Schema (OpenAPI) is RankManifest's
            python_schema=core_schema.union_schema([core_schema.is_instance_schema(StoredManifest), parsed]),
            serialization=core_schema.wrap_serializer_function_ser_schema(
                _stored_manifest_json, info_arg=True, schema=parsed
            ),
        )


def _embed(value: Any) -> Any:
    if isinstance(value, StoredManifest):
        return orjson.Fragment(value.text)
    raise TypeError(f"cannot serialise {type(value).__name__} as JSON")


def dump_json(model: BaseModel) -> bytes:
    """`model` as JSON bytes (orjson, one pass); a StoredManifest goes in as its text, unparsed."""
    return orjson.dumps(model.model_dump(), default=_embed)


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
    compile_cache_keys: list[str] = []


class Registration(InstanceView):
    """201 answer to a registration: the instance plus its bearer token (shown once, never in repr)."""

    token: str = Field(repr=False)
    # the key the seed's control endpoint checks per-assignment tokens with (derived from the planner's
    # secret, planner.control_token; shown once, never stored); None without a control_url
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
    """The identity's anchored digest set for a rank (planner.integrity.digest_set) and who anchored it."""

    checksum_algorithm: str
    digest_set: str
    instance_id: str


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
    manifest: Annotated[RankManifest | StoredManifest, _ManifestOrStored] = Field(repr=False)

    def address_bytes(self) -> bytes:
        """The seed rank's engine address (base64 on the wire)."""
        return _b64decode(self.address, "address")

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
    """POST /v1/compile-caches/{key}/sources: the requester's labels (nearest sources first)."""

    labels: Labels = Labels()


class CompileCacheSource(BaseModel):
    """A READY instance whose control endpoint serves a compile cache, with a token for one fetch."""

    instance_id: str
    control_url: str
    labels: Labels
    # planner.control_token for GET {control_url}/v1/compile-caches/{key}; opens no weight session
    control_token: str = Field(repr=False)


class CompileCacheSources(BaseModel):
    """Answer to POST /v1/compile-caches/{key}/sources: who serves that key, nearest first."""

    cache_key: str
    sources: list[CompileCacheSource]


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


class AnchorsPage(BaseModel):
    """GET /v1/anchors (admin)."""

    items: list[AnchorView]
    total: int


class ReportAnswer(BaseModel):
    """Answer to a report."""

    id: str
    outcome: str
    seed_quarantined: bool


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


# ---- the fleet page (GET /v1/fleet, /ui) and what loaders tell it during a pull --------------


class ProgressReport(Strict):
    """POST /v1/assignments/{id}/progress: bytes read so far of a live pull (its holder only)."""

    bytes_done: Bytes
    bytes_total: Bytes


class SeededReport(Strict):
    """POST /v1/assignments/{id}/seeded: the instance now serving what this pull read (its holder only).

    Links a loader's pull to the seed it became, so the fan-out tree can chain seed -> loader -> loader.
    """

    instance_id: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]


class FleetAnchor(BaseModel):
    """An identity's anchored digest set for one rank (short digest) and the instance that anchored it."""

    rank: int
    checksum_algorithm: str
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


class FleetView(BaseModel):
    """GET /v1/fleet: everything the fleet page draws, for the reader role."""

    now: float
    identities: list[FleetIdentity]
    instances: list[FleetInstance]
    edges: list[FleetEdge]
    transfers: list[FleetTransfer]
    refusals: list[Refusal]
