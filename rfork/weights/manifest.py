"""Rank manifests (docs/contracts.md): which regions a rank serves and where each tensor lies in them."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from backends.layout import dtype_from_name, expected_nbytes
from rfork.errors import ManifestError


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    region: int
    offset: int
    checksum: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "region": self.region,
            "offset": self.offset,
            "checksum": self.checksum,
        }


@dataclass(frozen=True, kw_only=True)
class RegionEntry:
    index: int
    nbytes: int
    descriptor: bytes  # MemoryRegionDescriptor.to_bytes(); base64 on the wire

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "nbytes": self.nbytes,
            "descriptor": base64.b64encode(self.descriptor).decode("ascii"),
        }


@dataclass(frozen=True, kw_only=True)
class RankManifest:
    rank: int
    checksum_algorithm: str
    regions: tuple[RegionEntry, ...]
    tensors: tuple[TensorEntry, ...] = field(default=())

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "checksum_algorithm": self.checksum_algorithm,
            "regions": [r.to_dict() for r in self.regions],
            "tensors": [t.to_dict() for t in self.tensors],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankManifest:
        """Parse and validate (types, dtype/shape/nbytes agreement, bounds, unique names)."""
        if not isinstance(data, Mapping):
            raise ManifestError("manifest must be a JSON object")
        try:
            rank = _int(data["rank"], "rank")
            algo = data["checksum_algorithm"]
            if not isinstance(algo, str) or not algo:
                raise ManifestError("checksum_algorithm must be a non-empty string")
            regions = tuple(_region(r, i) for i, r in enumerate(_list(data["regions"], "regions")))
            tensors = tuple(_tensor(t) for t in _list(data["tensors"], "tensors"))
        except KeyError as exc:
            raise ManifestError(f"manifest lacks field {exc.args[0]!r}") from exc
        by_index = {r.index: r for r in regions}
        if len(by_index) != len(regions):
            raise ManifestError("duplicate region index")
        names: set[str] = set()
        for t in tensors:
            if t.name in names:
                raise ManifestError(f"duplicate tensor {t.name!r}")
            names.add(t.name)
            if t.nbytes == 0:
                continue
            reg = by_index.get(t.region)
            if reg is None:
                raise ManifestError(f"tensor {t.name!r} names missing region {t.region}")
            if t.offset + t.nbytes > reg.nbytes:
                raise ManifestError(
                    f"tensor {t.name!r} [{t.offset}, +{t.nbytes}) overruns region {t.region} "
                    f"({reg.nbytes} bytes)"
                )
        return cls(rank=rank, checksum_algorithm=algo, regions=regions, tensors=tensors)


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ManifestError(f"{what} must be a list")
    return value


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ManifestError(f"{what} must be a non-negative int, got {value!r}")
    return value


def _region(data: Any, position: int) -> RegionEntry:
    if not isinstance(data, Mapping):
        raise ManifestError(f"regions[{position}] must be an object")
    desc = data["descriptor"]
    if not isinstance(desc, str):
        raise ManifestError(f"regions[{position}].descriptor must be a base64 string")
    try:
        raw = base64.b64decode(desc, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ManifestError(f"regions[{position}].descriptor is not base64") from exc
    return RegionEntry(
        index=_int(data["index"], "region index"),
        nbytes=_int(data["nbytes"], "region nbytes"),
        descriptor=raw,
    )


def _tensor(data: Any) -> TensorEntry:
    if not isinstance(data, Mapping):
        raise ManifestError("tensor entry must be an object")
    name = data["name"]
    if not isinstance(name, str) or not name:
        raise ManifestError("tensor name must be a non-empty string")
    dtype = data["dtype"]
    if not isinstance(dtype, str):
        raise ManifestError(f"tensor {name!r}: dtype must be a string")
    dims = _list(data["shape"], f"tensor {name!r} shape")
    shape = tuple(_int(d, f"tensor {name!r} shape entry") for d in dims)
    nbytes = _int(data["nbytes"], f"tensor {name!r} nbytes")
    try:
        want = expected_nbytes(dtype_from_name(dtype), shape)
    except ValueError as exc:
        raise ManifestError(f"tensor {name!r}: {exc}") from exc
    if nbytes != want:
        raise ManifestError(f"tensor {name!r}: nbytes {nbytes} != {want} for {dtype}{list(shape)}")
    checksum = data["checksum"]
    if not isinstance(checksum, str):
        raise ManifestError(f"tensor {name!r}: checksum must be a string")
    return TensorEntry(
        name=name,
        dtype=dtype,
        shape=shape,
        nbytes=nbytes,
        region=_int(data["region"], f"tensor {name!r} region"),
        offset=_int(data["offset"], f"tensor {name!r} offset"),
        checksum=checksum,
    )
