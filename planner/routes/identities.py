"""/v1/identities: what the planner knows across identities (a rollout's other sources)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query

from planner.auth import Principal
from planner.contract import views
from planner.deps import get_planner, leaser
from planner.service import Planner

router = APIRouter(prefix="/v1/identities", tags=["identities"])
ERRORS: dict[int | str, dict[str, Any]] = {401: {}, 403: {}, 422: {}}
KeyPath = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$", description="identity key (64 hex digits)")]


@router.get(
    "/{identity_key}/shared",
    response_model=views.SharedPage,
    responses=ERRORS,
    operation_id="shared_identities",
)
def shared_identities(
    identity_key: KeyPath,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(leaser),
    rank: Annotated[int, Query(ge=0, le=1_000_000, description="global rank")] = 0,
    checksum_algorithm: Annotated[
        str, Query(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:+-]+$")
    ] = "blake3",
    limit: Annotated[int, Query(ge=1, le=100)] = 10,
) -> views.SharedPage:
    """Identities with READY instances whose anchored digests share tensors with this one's at `rank`
    (equal name and digest), most shared first: a loader of a new version reads those tensors from
    seeds of the old one."""
    return planner.shared_identities(
        identity_key, rank=rank, checksum_algorithm=checksum_algorithm, limit=limit
    )
