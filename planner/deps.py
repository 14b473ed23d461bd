"""FastAPI dependencies: the app's Planner and the calling principal."""

from __future__ import annotations

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from planner.auth import INSECURE, Authenticator, Principal
from planner.service import Planner

bearer = HTTPBearer(auto_error=False, description="Bearer token (admin, instance or reader)")


async def get_planner(request: Request) -> Planner:
    """The Planner this app serves."""
    planner: Planner = request.app.state.planner
    return planner


async def get_principal(
    request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)
) -> Principal:
    """Who calls; 401 without a known token (unless the server runs --insecure)."""
    auth: Authenticator | None = request.app.state.authenticator
    if auth is None:
        return INSECURE
    guarded: Principal | None = getattr(request.state, "principal", None)  # planner.guard checked it
    if guarded is not None:
        return guarded
    if creds is None or not creds.credentials:
        raise HTTPException(
            401, "Authorization: a bearer token is required", headers={"WWW-Authenticate": "Bearer"}
        )
    # async (no threadpool hop per request): cached tokens answer on the loop, a miss looks up in a thread
    cached = auth.authenticate_cached(creds.credentials)
    principal = (
        await run_in_threadpool(auth.authenticate, creds.credentials)
        if cached is False or cached is True
        else cached
    )
    if principal is None:
        raise HTTPException(401, "Authorization: unknown token", headers={"WWW-Authenticate": "Bearer"})
    return principal


async def writer(principal: Principal = Depends(get_principal)) -> Principal:
    """A principal allowed to change things (admin or instance)."""
    if not principal.may_write():
        raise HTTPException(403, f"Authorization: role {principal.role} may only read")
    return principal


async def leaser(principal: Principal = Depends(get_principal)) -> Principal:
    """A principal allowed to request assignments (load role, an instance token, admin)."""
    if not principal.may_lease():
        raise HTTPException(403, f"Authorization: role {principal.role} may not request assignments")
    return principal


async def registrar(principal: Principal = Depends(get_principal)) -> Principal:
    """A principal allowed to register instances (register role, admin)."""
    if not principal.has("register"):
        raise HTTPException(403, f"Authorization: role {principal.role} may not register instances")
    return principal


def owner_of(instance_id: str, principal: Principal) -> None:
    """403 unless the principal may change `instance_id`."""
    if not principal.may_change(instance_id):
        raise HTTPException(403, f"Authorization: this token may not change instance {instance_id}")


async def administrator(principal: Principal = Depends(get_principal)) -> Principal:
    """An admin (anchors: who may set, list or revoke them is the operator's decision)."""
    if not principal.has("admin"):
        raise HTTPException(403, f"Authorization: role {principal.role} may not manage anchors")
    return principal
