"""Read-only views (/v1/models, /v1/transfers) and operations endpoints (/metrics, /healthz, /readyz)."""

from __future__ import annotations

import logging
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy import text

from planner.auth import Principal
from planner.contract.views import ModelsPage, TransfersPage
from planner.database_down import RETRY_AFTER_S, UNAVAILABLE, database_unavailable
from planner.deps import get_planner, get_principal
from planner.service import Planner

log = logging.getLogger(__name__)
router = APIRouter(tags=["views"])


@router.get("/v1/models", response_model=ModelsPage, responses={401: {}})
def models(
    planner: Planner = Depends(get_planner), principal: Principal = Depends(get_principal)
) -> ModelsPage:
    """Identities known to the planner with their instance and READY counts."""
    return planner.models(time.time())


@router.get("/v1/transfers", response_model=TransfersPage, responses={401: {}, 422: {}})
def transfers(
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(get_principal),
    seed_id: Annotated[str | None, Query(pattern=r"^[0-9a-f]{32}$")] = None,
    outcome: Literal["success", "failure", "expired", "released"] | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> TransfersPage:
    """Finished assignments, newest first, with bytes, seconds and GB/s."""
    return planner.transfers(limit=limit, offset=offset, seed_id=seed_id, outcome=outcome)


@router.get("/healthz", tags=["ops"])
def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz", tags=["ops"], responses={503: {}})
def readyz(planner: Planner = Depends(get_planner)) -> Response:
    """The database answers."""
    try:
        with planner.db.read() as s:
            s.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001 - any database failure means not ready
        return JSONResponse(
            {"status": "unavailable", "detail": f"database: {type(exc).__name__}"},
            503,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    return JSONResponse({"status": "ready"})


@router.get("/metrics", tags=["ops"], response_class=Response)
def metrics(request: Request, planner: Planner = Depends(get_planner)) -> Response:
    """Prometheus text exposition; with the database unreachable, the gauges it feeds keep their last
    values (the request counters show the 503s)."""
    m = request.app.state.metrics
    now = time.time()
    try:
        counts = planner.status_counts()
        live = planner.live_leases(now)
        out_of_service = planner.out_of_service(now)
        flagged = planner.flagged_reporters()
    except UNAVAILABLE as exc:
        log.warning("/metrics: database unavailable, instance and lease gauges not updated: %s",
                    database_unavailable(exc))
    else:
        for status in ("INITIALIZING", "LOADING", "READY", "DRAINING", "STALE"):
            m.instances.labels(status=status).set(counts.get(status, 0))
        m.live_leases.set(live)
        for cause, n in out_of_service.items():
            m.quarantined.labels(cause=cause).set(n)
        m.flagged_reporters.set(len(flagged))
        m.reporter_disproved.clear()
        for reporter, n in flagged.items():
            m.reporter_disproved.labels(reporter=reporter).set(n)
    body, content_type = m.exposition()
    return Response(body, media_type=content_type)
