"""Rank manifests on the wire: which regions a rank serves and where each tensor lies in them.

A loader calls `RankManifest.check()` once where it receives a manifest (the one place its invariants
are checked, with the dtype sizes here so that no torch is needed); the planner stores a published
manifest's text verbatim and hands it back unparsed (`StoredManifest`, `dump_json`).
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    Field,
    GetCoreSchemaHandler,
    PrivateAttr,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    StringConstraints,
    model_serializer,
)
from pydantic_core import CoreSchema, core_schema

from planner.contract.fields import (
    JSON_INT,
    MAX_BYTES,
    NO_NUL,
    Bytes,
    Rank,
    RegionIndex,
    Strict,
    b64decode,
)


class RegionEntry(BaseModel):
    """One registered memory region of a rank."""

    index: RegionIndex
    nbytes: Bytes
    descriptor: Annotated[str, StringConstraints(max_length=1_048_576)]

    def descriptor_bytes(self) -> bytes:
        """MemoryRegionDescriptor.to_bytes() (base64 on the wire; "" where the reader may not see it)."""
        return b64decode(self.descriptor, f"regions[index={self.index}].descriptor")


class TensorStripes(BaseModel):
    """A tensor's digests per stripe: `len(digests)` equal slices along `dim`, each digested (the
    manifest's algorithm) over its bytes in row-major order, so that a rank holding whole stripes (a
    TP shard) can verify exactly what it read (rfork.weights.stripes)."""

    dim: Annotated[int, Field(ge=0, le=63), JSON_INT]
    digests: Annotated[
        list[Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NO_NUL)]],
        Field(min_length=2, max_length=64),
    ]


class TensorEntry(BaseModel):
    """One tensor of a rank and where it lives in the regions."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    dtype: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    shape: Annotated[list[Annotated[int, Field(ge=0, le=MAX_BYTES), JSON_INT]], Field(max_length=64)]
    nbytes: Bytes
    region: RegionIndex
    offset: Bytes
    checksum: Annotated[str, StringConstraints(max_length=1024)]
    stripes: TensorStripes | None = None  # where a rank may read part of it (covered by the digest set)

    @model_serializer(mode="wrap")
    def _without_absent_stripes(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _omit_absent_stripes(handler(self))


class TensorDigest(Strict):
    """One tensor of an anchor upload: what the digest set covers (planner.contract.integrity.digest_set)."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=NO_NUL)]
    dtype: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=NO_NUL)]
    shape: Annotated[list[Annotated[int, Field(ge=0, le=MAX_BYTES), JSON_INT]], Field(max_length=64)]
    nbytes: Bytes
    checksum: Annotated[str, StringConstraints(max_length=1024, pattern=NO_NUL)]
    stripes: TensorStripes | None = None

    @model_serializer(mode="wrap")
    def _without_absent_stripes(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _omit_absent_stripes(handler(self))


def _omit_absent_stripes(data: Any) -> Any:
    """A tensor without stripes serializes as it did before the field existed (no `"stripes": null`)."""
    if isinstance(data, dict) and data.get("stripes", 0) is None:
        del data["stripes"]
    return data


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
            bad = stripes_conflict(t.shape, t.stripes)
            if bad is not None:
                return f"tensors[{i}]: {bad}"
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
            bad = stripes_conflict(t.shape, t.stripes)
            if bad is not None:
                raise ValueError(f"tensor {t.name!r}: {bad}")
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


def stripes_conflict(shape: list[int], stripes: TensorStripes | None) -> str | None:
    """Why `stripes` cannot be stripes of a tensor of `shape` (a dim it lacks, a size the count does not
    divide), or None."""
    if stripes is None:
        return None
    if stripes.dim >= len(shape):
        return f"stripes along dim {stripes.dim} of a {len(shape)}-dim tensor"
    if shape[stripes.dim] % len(stripes.digests):
        return f"{len(stripes.digests)} stripes do not divide dim {stripes.dim} of size {shape[stripes.dim]}"
    return None


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


class ManifestOrStored:
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
