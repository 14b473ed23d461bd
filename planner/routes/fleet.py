"""The fleet page: /ui (static, holds no data), /v1/fleet (its data, reader role), and what a loader
tells it during and after a pull (/v1/assignments/{id}/progress and /seeded, the lease holder only)."""

from __future__ import annotations

import time
from importlib import resources
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Request, Response
from starlette.concurrency import run_in_threadpool

from planner import fleet
from planner.auth import Principal
from planner.contract import views, wire
from planner.deps import get_planner, get_principal, leaser
from planner.service import Planner

router = APIRouter(tags=["fleet"])

# Everything the page loads comes from here; inline script and style are refused outright, so a name
# that slipped into the DOM as markup still could not run.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "fleet.js": "text/javascript; charset=utf-8",
    "fleet.css": "text/css; charset=utf-8",
}
_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
AssignmentId = Annotated[str, Path(pattern=r"^[0-9a-f]{32}$")]


def _asset(name: str) -> Response:
    body = resources.files("planner").joinpath("ui", name).read_bytes()
    return Response(body, media_type=ASSETS[name], headers=_HEADERS)


@router.get("/ui", response_class=Response, include_in_schema=False)
def page() -> Response:
    """The fleet page (static: it asks /v1/fleet with the reader token the user pastes)."""
    return _asset("index.html")


@router.get("/ui/{name}", response_class=Response, include_in_schema=False)
def asset(name: str) -> Response:
    """The page's script and style sheet."""
    if name not in ASSETS:
        raise HTTPException(404, f"no such file: {name[:64]}")
    return _asset(name)


@router.get("/v1/fleet", response_model=views.FleetView, responses={401: {}})
def fleet_view(
    request: Request, planner: Planner = Depends(get_planner), principal: Principal = Depends(get_principal)
) -> views.FleetView:
    """Identities, instances, the fan-out tree, recent transfers and refusals (any role, reader included)."""
    st = request.app.state
    return fleet.fleet_view(
        planner.db, planner.settings, st.progress, st.refusals, time.time(), planner.flagged_reporters()
    )


@router.post(
    "/v1/assignments/{assignment_id}/progress",
    status_code=204,
    operation_id="report_progress",
    response_class=Response,
    responses={400: {}, 401: {}, 403: {}, 404: {}, 409: {}, 413: {}, 422: {}},
)
async def report_progress(
    assignment_id: AssignmentId,
    body: wire.ProgressReport,
    request: Request,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(leaser),
) -> Response:
    """Bytes read so far of a live pull (its holder only; 409 once the lease has ended)."""
    holder = None if principal.has("admin") else principal.holder
    try:
        await run_in_threadpool(
            fleet.record_progress,
            planner.db,
            request.app.state.progress,
            assignment_id,
            body,
            holder=holder,
            now=time.time(),
        )
    except PermissionError as exc:
        raise HTTPException(403, f"assignment: {exc}") from exc
    return Response(status_code=204)


@router.post(
    "/v1/assignments/{assignment_id}/seeded",
    status_code=204,
    operation_id="report_seeded",
    response_class=Response,
    responses={400: {}, 401: {}, 403: {}, 404: {}, 409: {}, 413: {}, 422: {}},
)
async def report_seeded(
    assignment_id: AssignmentId,
    body: wire.SeededReport,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(leaser),
) -> Response:
    """The instance now serving what a successful pull read (its holder only): links the tree."""
    holder = None if principal.has("admin") else principal.holder
    try:
        await run_in_threadpool(fleet.mark_seeded, planner.db, assignment_id, body.instance_id, holder=holder)
    except PermissionError as exc:
        raise HTTPException(403, f"assignment: {exc}") from exc
    return Response(status_code=204)
