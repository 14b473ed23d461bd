"""Error answers of the planner's HTTP API, one definition for the app's handlers and planner.hotpath."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from planner.contract.errors import AllBusy, AuthError, BadRequest, Conflict, NoSource, NotFound, PlannerError

_STATUS = {NotFound: 404, Conflict: 409, BadRequest: 422, AuthError: 403}


def error_response(status: int, detail: Any, **extra: Any) -> JSONResponse:
    """`{"detail": ..., **extra}`; a `retry_after_s` also becomes a Retry-After header (whole seconds)."""
    return JSONResponse(
        {"detail": detail, **extra},
        status_code=status,
        headers={"Retry-After": str(max(1, round(extra["retry_after_s"])))}
        if "retry_after_s" in extra
        else None,
    )


def planner_error_response(exc: PlannerError) -> JSONResponse:
    """The answer to a service error: 429 all_busy with its estimate, 404, 409, 422, 403, else 400."""
    if isinstance(exc, AllBusy):
        return error_response(
            429,
            str(exc),
            reason="all_busy",
            retry_after_s=exc.retry_after_s,
            expected_pull_s=exc.expected_pull_s,
            fallback=exc.fallback,
        )
    code = next((c for t, c in _STATUS.items() if isinstance(exc, t)), 400)
    extra: dict[str, Any] = {"reason": exc.reason} if exc.reason else {}
    if isinstance(exc, NoSource) and not exc.anchored:
        extra["anchored"] = False
    return error_response(code, str(exc), **extra)
