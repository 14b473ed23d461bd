"""/v1/anchors (admin): the digests an identity's rank must have; list, upload, revoke."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Response

from planner.auth import Principal
from planner.contract import views, wire
from planner.deps import administrator, get_planner
from planner.service import Planner

router = APIRouter(prefix="/v1/anchors", tags=["anchors"])
ERRORS: dict[int | str, dict[str, Any]] = {401: {}, 403: {}, 422: {}}
KeyPath = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$", description="identity key (64 hex digits)")]
RankPath = Annotated[int, Path(ge=0, le=1_000_000, description="global rank")]
AlgoPath = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:+-]+$")]


@router.get("", response_model=views.AnchorsPage, responses=ERRORS, operation_id="list_anchors")
def list_anchors(
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(administrator),
    identity_key: Annotated[str | None, Query(pattern=r"^[0-9a-f]{64}$")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> views.AnchorsPage:
    """Every anchor (optionally of one identity), oldest first, with who set it."""
    return planner.list_anchors(identity_key=identity_key, limit=limit, offset=offset)


@router.put(
    "",
    response_model=views.AnchorView,
    responses={
        **ERRORS,
        400: {},
        409: {"description": "a rank outside tp*pp, or a tensor listed twice"},
        413: {},
    },
    operation_id="put_anchor",
)
def put_anchor(
    body: wire.AnchorUpload,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(administrator),
) -> views.AnchorView:
    """Set (or replace) an identity's rank anchor from digests made from the checkpoint (`rfork digest`)."""
    return planner.put_anchor(body, time.time(), set_by=principal.holder)


@router.delete(
    "/{identity_key}/{rank}/{checksum_algorithm}",
    status_code=204,
    responses={**ERRORS, 404: {}},
    operation_id="revoke_anchor",
)
def revoke_anchor(
    identity_key: KeyPath,
    rank: RankPath,
    checksum_algorithm: AlgoPath,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(administrator),
) -> Response:
    """Revoke an anchor: nobody serves that rank until an authority sets one again."""
    planner.revoke_anchor(identity_key, rank, checksum_algorithm)
    return Response(status_code=204)
