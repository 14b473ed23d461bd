"""The planner's exception hierarchy, shared by the client and the service."""

from __future__ import annotations


class PlannerError(Exception):
    """Base of every planner error; `status` is the HTTP status when one came back."""

    def __init__(self, message: str, *, status: int | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class BadRequest(PlannerError):
    """The planner refused the request's content (400/413/422); the message names the field."""


class ProtocolMismatch(BadRequest):
    """The planner does not speak this client's wire protocol (400 `protocol_version`,
    planner.contract.protocol): no retry helps; run releases of one protocol."""


class AuthError(PlannerError):
    """Missing or wrong token (401), or a token without the right (403)."""


class NotFound(PlannerError):
    """The instance, manifest or assignment does not exist (404)."""


class NoSource(NotFound):
    """No READY identical source for this rank (404 `no_source`): load from disk. `anchored` False: the
    identity's rank has no anchor at all, so no instance of it is served until an authority sets one."""

    def __init__(self, message: str, *, anchored: bool = True) -> None:
        super().__init__(message, status=404, reason="no_source")
        self.anchored = anchored


class Conflict(PlannerError):
    """The request contradicts the current state, e.g. an illegal status transition (409)."""


class AllBusy(PlannerError):
    """Sources exist but every one is at its pull limit (429); retry after `retry_after_s` seconds."""

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float,
        expected_pull_s: float | None = None,
        fallback: bool = False,
    ) -> None:
        super().__init__(message, status=429, reason="all_busy")
        self.retry_after_s = retry_after_s
        # planner.burst: how long a pull is expected to take once a seed is free, and whether the
        # requester's stated fallback (disk, hub) would finish sooner than waiting for one
        self.expected_pull_s = expected_pull_s
        self.fallback = fallback


class PlannerUnavailable(PlannerError):
    """The planner could not be reached or failed (connection error, timeout, 5xx)."""


class DigestMismatch(Conflict):
    """A manifest's digest set differs from the identity's anchored one (409 `digest_mismatch`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=409, reason="digest_mismatch")
