"""/v1/compile-caches: a key's anchored archive digest, and which READY instances serve it, with a token to
fetch it."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Response

from planner.auth import Principal
from planner.contract import views, wire
from planner.deps import get_planner, leaser, writer
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
        404: {
            "description": 'no anchored archive digest for this key: `{"reason": "not_anchored"}`; no READY'
            ' instance of its identity with anchored weights serves it: `{"reason": "no_source"}` (compile)'
        },
    },
    operation_id="compile_cache_sources",
)
def compile_cache_sources(
    cache_key: KeyPath,
    body: wire.CompileCacheRequest,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(leaser),
) -> wire.CompileCacheSources:
    """The key's anchored archive digest and the instances serving it, nearest first, each with a token
    for one fetch of this key from its control endpoint.

    The request names the identity whose key it asks for: only when the key's anchor is that identity's
    are its READY instances whose manifests all match their anchors offered; an instance token sees only
    its own identity (as for assignments).
    """
    return planner.compile_cache_sources(cache_key, body, time.time(), may_lease=principal.may_lease_identity)


@router.post(
    "/{cache_key}/reports",
    status_code=204,
    responses={
        400: {"description": "the body is not JSON"},
        401: {},
        403: {},
        413: {"description": "the body exceeds the size limit"},
        422: {},
        404: {"description": "the key is not anchored for an identity this token loads, or the instance"
              " does not serve it"},
    },
    operation_id="report_compile_cache",
)
def report_compile_cache(
    cache_key: KeyPath,
    body: wire.CompileCacheReport,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(leaser),
) -> Response:
    """How a fetch from one source went (`verified` or `failed`): sources are ranked by these reports,
    so a loader's failed decoys go last for the next loader and the seed that served comes first."""
    planner.report_compile_cache(cache_key, body, may_lease=principal.may_lease_identity)
    return Response(status_code=204)


@router.put(
    "/{cache_key}/anchor",
    response_model=views.CompileCacheAnchorView,
    responses={
        400: {"description": "the body is not JSON"},
        401: {},
        403: {"description": "neither an admin nor an anchor-role instance serving this key"},
        409: {
            "description": "anchored with another digest (an admin may `replace`), a foreign identity, or a"
            " key that is not the identity's (`key_variant`)"
        },
        413: {"description": "the body exceeds the size limit"},
        422: {},
    },
    operation_id="anchor_compile_cache",
)
def anchor_compile_cache(
    cache_key: KeyPath,
    body: wire.CompileCacheAnchorUpload,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(writer),
) -> views.CompileCacheAnchorView:
    """Set the archive digest loaders install for `cache_key`: an admin's upload, or the first
    publication of an instance registered with the anchor role that serves the key."""
    return planner.anchor_compile_cache(cache_key, body, time.time(), principal=principal)
