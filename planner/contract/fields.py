"""What a wire field may hold: the bounds and patterns that make every bad input a 4xx, never a 500.

Shared by planner.contract.wire's models and the routes' query parameters (NO_NUL).
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints


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
# rfork.compile_cache.key.CompileCacheKey.variant(): the key's other fields (wire.compile_cache_key)
CompileCacheVariant = Annotated[
    str, StringConstraints(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")
]
# rfork.compile_cache.archive.archive_digest(): sha256 of a packed archive's bytes
ArchiveDigest = Annotated[str, StringConstraints(pattern=r"^sha256:[0-9a-f]{64}$")]
IdentityKey = Annotated[str, StringConstraints(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")]

def b64decode(value: str, what: str) -> bytes:
    """Strict base64 (no stray characters), or a ValueError naming the field (a 422)."""
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{what} must be base64") from exc


class Strict(BaseModel):
    """Unknown fields are refused, so a typo is a 422 naming it instead of silently ignored."""

    model_config = ConfigDict(extra="forbid")
