"""The R-Fork planner: which running instance a new instance should pull its weights from."""

from planner.errors import (
    AllBusy,
    AuthError,
    BadRequest,
    Conflict,
    NotFound,
    PlannerError,
    PlannerUnavailable,
)

__all__ = ["AllBusy", "AuthError", "BadRequest", "Conflict", "NotFound", "PlannerError", "PlannerUnavailable"]
