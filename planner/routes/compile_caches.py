"""/v1/compile-caches: which READY instances serve a compile cache, with a token to fetch it."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Path

from planner.auth import Principal
from planner.contract import wire
from planner.deps import get_planner, leaser
from planner.service import Planner

router = APIRouter(prefix="/v1/compile-caches", tags=["compile caches"])
KeyPath = Annotated[
    str, Path(pattern=r"^[0-9a-f]{64}$", description="compile-cache key (rfork.compile_cache.key, 64 hex)")
]


@router.post(
    "/{cache_key}/sources",
    response_model=wire.CompileCacheSources,
    responses={
        400: {"description": "the body is not JSON"},
        401: {},
        403: {},
        413: {"description": "the body exceeds the size limit"},
        422: {},
        404: {"description": 'no READY instance serves this key: `{"reason": "no_source"}` (compile)'},
    },
    operation_id="compile_cache_sources",
)
def compile_cache_sources(
    cache_key: KeyPath,
    body: wire.CompileCacheRequest,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(leaser),
) -> wire.CompileCacheSources:
    """Instances serving `cache_key`, nearest first, each with a one-fetch token for its control endpoint.

    An instance token sees only instances of its own identity (as for assignments).
    """
    return planner.compile_cache_sources(
        cache_key, time.time(), may_lease=principal.may_lease_identity, labels=body.labels
    )
