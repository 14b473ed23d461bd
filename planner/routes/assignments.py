"""/v1/assignments: lease a source for a rank; report how the pull went."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Request, Response

from planner.auth import Principal
from planner.contract import wire
from planner.contract.errors import AllBusy, NoSource
from planner.contract.manifest import dump_json
from planner.deps import get_planner, leaser
from planner.service import Planner

router = APIRouter(prefix="/v1/assignments", tags=["assignments"])

# the reason a loader reports for a pull it stopped itself (a signal; rfork.pull.planner_session)
ABORTED = "aborted"


@router.post(
    "",
    status_code=201,
    response_model=wire.Assignment,
    operation_id="request_assignment",
    responses={
        400: {"description": "the body is not JSON"},
        401: {},
        403: {},
        413: {"description": "the body exceeds the size limit"},
        422: {},
        404: {"description": 'no READY identical source: `{"reason": "no_source"}` (load from disk)'},
        429: {
            "description": 'every source is at its pull limit: `{"reason": "all_busy", "retry_after_s": x}`'
        },
        201: {
            "description": "a lease on candidates[0]",
            "links": {
                "Report": {
                    "operationId": "report_transfer",
                    "parameters": {"assignment_id": "$response.body#/id"},
                },
                "Progress": {
                    "operationId": "report_progress",
                    "parameters": {"assignment_id": "$response.body#/id"},
                },
            },
        },
    },
)
def request_assignment(
    body: wire.AssignmentRequest,
    request: Request,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(leaser),
) -> Response:
    """Ranked candidates for one rank, with a lease on the first (reported on only by its requester)."""
    refused = lease_refusal(principal, body)
    if refused is not None:
        raise HTTPException(403, refused)
    assignment = lease(planner, body, principal, request.app.state)
    # encoded here, not by FastAPI: the candidates' manifests go in as stored text, unparsed
    return Response(dump_json(assignment), status_code=201, media_type="application/json")


def lease_refusal(principal: Principal, body: wire.AssignmentRequest) -> str | None:
    """Why `principal` may not lease what `body` asks (the 403's detail), or None; an instance token
    acts for its own instance, so its requester_id is set to it."""
    if not principal.may_lease_identity(body.identity.key()):
        return "Authorization: this instance token leases its own identity only"
    if principal.instance_id is not None:
        if body.requester_id not in (None, principal.instance_id):
            return f"requester_id: this token acts for instance {principal.instance_id}"
        body.requester_id = principal.instance_id
    return None


def lease(
    planner: Planner, body: wire.AssignmentRequest, principal: Principal, state: Any
) -> wire.Assignment:
    """Planner.assign for an allowed caller, refusals kept for the fleet page, metrics counted
    (blocking: called in a worker thread, by this route and by planner.hotpath)."""
    # the clock is read under the write lock
    return leased(
        state,
        body,
        functools.partial(planner.assign, body, None, holder=principal.holder, credential=principal.witness),
    )


def leased(
    state: Any, body: wire.AssignmentRequest, answer: Callable[[], wire.Assignment]
) -> wire.Assignment:
    """`answer()` (Planner.assign, or the continuation of Planner.assign_in) with its refusals kept for
    the fleet page and the metrics counted."""
    try:
        assignment = answer()
    except (AllBusy, NoSource) as exc:
        reason = exc.reason or type(exc).__name__
        state.refusals.record(
            identity_key=body.identity.key(), rank=body.rank, reason=reason, detail=str(exc), now=time.time()
        )
        state.metrics.assignments.labels(result=reason).inc()
        raise
    state.metrics.assignments.labels(result="leased").inc()
    return assignment


@router.post(
    "/{assignment_id}/report",
    response_model=wire.ReportAnswer,
    responses={400: {}, 401: {}, 403: {}, 404: {}, 409: {}, 413: {}, 422: {}},
    operation_id="report_transfer",
)
def report(
    assignment_id: Annotated[str, Path(pattern=r"^[0-9a-f]{32}$")],
    body: wire.TransferReport,
    request: Request,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(leaser),
) -> wire.ReportAnswer:
    """End the lease with the pull's outcome and figures (its requester only; 409 once it has ended)."""
    try:
        return finish(planner, assignment_id, body, principal, request.app.state)
    except PermissionError as exc:
        raise HTTPException(403, f"assignment: {exc}") from exc


def finish(
    planner: Planner, assignment_id: str, body: wire.TransferReport, principal: Principal, state: Any
) -> wire.ReportAnswer:
    """Planner.report by the lease's holder (admin: anyone), metrics counted; PermissionError for
    another caller (blocking: called in a worker thread, by this route and by planner.hotpath)."""
    return finished(state, body, planner.report(assignment_id, body, None, reporter=reporter(principal)))


def reporter(principal: Principal) -> str | None:
    """Whose leases `principal` may report on: its holder's (None: an admin, anyone's)."""
    return None if principal.has("admin") else principal.holder


def finished(state: Any, body: wire.TransferReport, out: wire.ReportAnswer) -> wire.ReportAnswer:
    """A report's answer, its metrics counted (a pull its loader aborted is neither side's failure)."""
    aborted = body.outcome == "failure" and body.reason == ABORTED
    state.metrics.transfers.labels(outcome=ABORTED if aborted else body.outcome).inc()
    state.metrics.transfer_bytes.inc(body.bytes)
    return out


@router.post(
    "/{assignment_id}/renew",
    response_model=wire.LeaseRenewal,
    responses={401: {}, 403: {}, 404: {}, 409: {}, 422: {}},
    operation_id="renew_assignment",
)
def renew(
    assignment_id: Annotated[str, Path(pattern=r"^[0-9a-f]{32}$")],
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(leaser),
) -> wire.LeaseRenewal:
    """Keep a live lease for another lease_ttl_s (a long pull renews before it expires; 409 once ended)."""
    holder = None if principal.has("admin") else principal.holder
    try:
        return planner.renew(assignment_id, None, holder=holder)
    except PermissionError as exc:
        raise HTTPException(403, f"assignment: {exc}") from exc
