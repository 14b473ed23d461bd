"""Source identity: what makes two instances interchangeable, and the weights fingerprint."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

FIELDS_INT = ("tp", "pp", "ep", "dp")


class IdentityError(ValueError):
    """An identity object is malformed (missing field, wrong type)."""


def fingerprint(tensors: Iterable[tuple[str, str, Iterable[int]]]) -> str:
    """sha256 (hex) of the sorted (name, dtype, shape) triples of a model's full, unsharded tensors.

    Order of the input does not matter; dtype is the torch name without the "torch." prefix.
    """
    items = sorted(
        (name, str(dtype).removeprefix("torch."), [int(d) for d in shape]) for name, dtype, shape in tensors
    )
    h = hashlib.sha256()
    for name, dtype, shape in items:
        h.update(json.dumps([name, dtype, shape], separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


@dataclass(frozen=True, kw_only=True)
class SourceIdentity:
    """docs/contracts.md "Source identity"; every field required, equality means interchangeable."""

    model: str
    revision: str
    fingerprint: str
    dtype: str
    quantization: str = "none"
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    framework: str = "rfork"
    framework_version: str = "0"
    device_kind: str = "cpu"

    def __post_init__(self) -> None:
        for name in FIELDS_INT:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise IdentityError(f"identity field {name!r} must be a positive int, got {value!r}")
        for f in fields(self):
            if f.name not in FIELDS_INT and not isinstance(getattr(self, f.name), str):
                raise IdentityError(f"identity field {f.name!r} must be a string")

    @property
    def world_size(self) -> int:
        """Ranks that hold weights: tp * pp (global rank = pp_rank * tp + tp_rank)."""
        return self.tp * self.pp

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SourceIdentity:
        names = {f.name for f in fields(cls)}
        missing = names - set(data)
        if missing:
            raise IdentityError(f"identity lacks field(s) {sorted(missing)}")
        extra = set(data) - names
        if extra:
            raise IdentityError(f"identity has unknown field(s) {sorted(extra)}")
        return cls(**{k: data[k] for k in names})

    def key(self) -> str:
        """sha256 of the canonical JSON (sorted keys, no spaces), as the planner derives identity_key."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()


def global_rank(*, tp_rank: int, pp_rank: int, tp_size: int) -> int:
    """pp_rank * tp_size + tp_rank: never tp_rank alone (pipeline stages would collide)."""
    if not 0 <= tp_rank < tp_size or pp_rank < 0:
        raise IdentityError(f"bad rank tp_rank={tp_rank} pp_rank={pp_rank} tp_size={tp_size}")
    return pp_rank * tp_size + tp_rank
