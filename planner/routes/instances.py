"""/v1/instances: register, read, list, status, heartbeat, delete, rank manifests."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from planner.auth import Principal
from planner.contract import fields, wire
from planner.contract.errors import DigestMismatch, NotFound
from planner.contract.views import InstancePage
from planner.deps import get_planner, get_principal, owner_of, registrar, writer
from planner.service import Planner

router = APIRouter(prefix="/v1/instances", tags=["instances"])
IdPath = Annotated[str, Path(pattern=r"^[0-9a-f]{32}$", description="instance id (32 hex digits)")]
RankPath = Annotated[int, Path(ge=0, le=1_000_000, description="global rank")]
ERRORS: dict[int | str, dict[str, Any]] = {401: {}, 403: {}, 404: {}, 422: {}}
BODY_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    400: {"description": "the body is not JSON (or not UTF-8)"},
    413: {"description": "the body exceeds the route's size limit"},
}
ID = "$response.body#/id"
# OpenAPI links: what a registration's id can be used for (lets clients and the stateful tests follow)
INSTANCE_LINKS = {
    "GetInstance": {"operationId": "get_instance", "parameters": {"instance_id": ID}},
    "SetStatus": {"operationId": "set_status", "parameters": {"instance_id": ID}},
    "Heartbeat": {"operationId": "heartbeat", "parameters": {"instance_id": ID}},
    "PutManifest": {"operationId": "put_manifest", "parameters": {"instance_id": ID, "rank": 0}},
    "DeleteInstance": {"operationId": "delete_instance", "parameters": {"instance_id": ID}},
}


@router.post(
    "",
    status_code=201,
    response_model=wire.Registration,
    responses={
        **BODY_ERRORS,
        409: {
            "description": "the body contradicts itself (a rank outside tp*pp, or listed twice), or the"
            " registering credential has max_instances_per_credential instances"
        },
        201: {"description": "registered", "links": INSTANCE_LINKS},
    },
    operation_id="register_instance",
)
def register(
    body: wire.RegistrationRequest,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(registrar),
) -> wire.Registration:
    """Register an instance (INITIALIZING); the answer carries a token scoped to it.

    The token may lease (its own identity) only when the registering token holds the load role, and the
    instance's disk publications anchor its identity only when it holds the anchor role.
    """
    conflict = body.conflicts()
    if conflict is not None:
        raise HTTPException(409, conflict)
    return planner.register(
        body,
        time.time(),
        may_anchor=principal.has("anchor"),
        may_lease=principal.has("load"),
        registered_by=principal.holder,
    )


@router.get("", response_model=InstancePage, responses=ERRORS, operation_id="list_instances")
def list_instances(
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(get_principal),
    model: Annotated[str | None, Query(max_length=512, pattern=fields.NO_NUL)] = None,
    fingerprint: Annotated[str | None, Query(max_length=256, pattern=fields.NO_NUL)] = None,
    status: wire.InstanceStatus | None = None,
    node: Annotated[str | None, Query(max_length=256, pattern=fields.NO_NUL)] = None,
    identity_key: Annotated[str | None, Query(max_length=64, pattern=fields.NO_NUL)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> InstancePage:
    """Instances filtered by model, fingerprint, status, node or identity_key; paginated."""
    return planner.list(
        model=model,
        fingerprint=fingerprint,
        status=status.value if status else None,
        node=node,
        identity_key=identity_key,
        limit=limit,
        offset=offset,
    )


@router.get("/{instance_id}", response_model=wire.InstanceView, responses=ERRORS, operation_id="get_instance")
def get_instance(
    instance_id: IdPath,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(get_principal),
) -> wire.InstanceView:
    """One instance."""
    return planner.get(instance_id)


@router.delete("/{instance_id}", status_code=204, responses=ERRORS, operation_id="delete_instance")
def delete_instance(
    instance_id: IdPath,
    request: Request,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(writer),
) -> Response:
    """Remove an instance (admin, or the instance itself)."""
    owner_of(instance_id, principal)
    planner.delete(instance_id, time.time())
    if request.app.state.authenticator is not None:
        request.app.state.authenticator.forget(instance_id)
    return Response(status_code=204)


@router.post(
    "/{instance_id}/status",
    response_model=wire.InstanceView,
    responses={**BODY_ERRORS, 409: {}},
    operation_id="set_status",
)
def set_status(
    instance_id: IdPath,
    body: wire.StatusChange,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(writer),
) -> wire.InstanceView:
    """INITIALIZING -> LOADING -> READY -> DRAINING (INITIALIZING -> READY, any -> DRAINING); else 409."""
    owner_of(instance_id, principal)
    return planner.set_status(instance_id, body.status, time.time())


@router.post(
    "/{instance_id}/heartbeat",
    response_model=wire.HeartbeatAnswer,
    responses=ERRORS,
    operation_id="heartbeat",
)
async def heartbeat(
    instance_id: IdPath,
    request: Request,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(writer),
) -> wire.HeartbeatAnswer:
    """Liveness; without one for ttl_s the instance turns STALE."""
    owner_of(instance_id, principal)
    # coalesced with concurrent heartbeats into one UPDATE (planner/heartbeats.py)
    beat = await request.app.state.heartbeats.beat(instance_id)
    if beat is None:
        raise NotFound(f"instance {instance_id} not found")
    return wire.HeartbeatAnswer(
        status=wire.InstanceStatus(beat[0]), ttl_s=planner.settings.heartbeat_ttl_s, reverify=beat[1]
    )


MANIFEST_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": wire.RankManifest.model_json_schema(ref_template="#/components/schemas/{model}")
            }
        },
    }
}


@router.put(
    "/{instance_id}/manifests/{rank}",
    status_code=204,
    openapi_extra=MANIFEST_BODY,
    responses={
        **BODY_ERRORS,
        409: {
            "description": "the body contradicts itself or the path's rank, or its digests differ from the "
            "identity's anchored set (digest_mismatch)"
        },
        204: {
            "description": "stored",
            "links": {
                "GetManifest": {
                    "operationId": "get_manifest",
                    "parameters": {"instance_id": "$request.path.instance_id", "rank": "$request.path.rank"},
                }
            },
        },
    },
    operation_id="put_manifest",
)
async def put_manifest(
    instance_id: IdPath,
    rank: RankPath,
    request: Request,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(writer),
) -> Response:
    """Store a rank manifest verbatim after checking its shape and size."""
    owner_of(instance_id, principal)
    limit = planner.settings.max_manifest_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"body: manifest of {declared} bytes exceeds the limit of {limit}")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise HTTPException(413, f"body: manifest exceeds the limit of {limit} bytes")
    # up to max_manifest_bytes of JSON: parsed in a worker thread, never on the event loop
    text, manifest, conflict = await run_in_threadpool(_parse_manifest, bytes(raw))
    if conflict is not None:
        raise HTTPException(409, f"body: {conflict}")
    if manifest.rank != rank:  # both well-formed, they contradict each other: a conflict, not bad input
        raise HTTPException(409, f"rank: manifest rank {manifest.rank} differs from the path's rank {rank}")
    metrics = request.app.state.metrics
    try:
        anchored = await run_in_threadpool(
            planner.put_manifest, instance_id, rank, text, time.time(), manifest
        )
    except DigestMismatch as exc:
        metrics.integrity_refusals.inc()
        identity_key = await run_in_threadpool(lambda: planner.get(instance_id).identity_key)
        request.app.state.refusals.record(
            identity_key=identity_key, rank=rank, reason="digest_mismatch", detail=str(exc), now=time.time()
        )
        raise
    if anchored:
        metrics.anchors.inc()
    return Response(status_code=204)


@router.get(
    "/{instance_id}/manifests/{rank}",
    responses={
        **ERRORS,
        200: {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/RankManifest"}}}},
    },
    operation_id="get_manifest",
)
def get_manifest(
    instance_id: IdPath,
    rank: RankPath,
    planner: Planner = Depends(get_planner),
    principal: Principal = Depends(get_principal),
) -> Response:
    """The manifest as the seed stored it; descriptors (data-plane keys) only for admins and its owner."""
    text = planner.get_manifest(instance_id, rank)
    if not principal.sees_descriptors(instance_id):
        doc = json.loads(text)
        for region in doc.get("regions", []):
            region["descriptor"] = ""
        text = json.dumps(doc)
    return Response(text, media_type="application/json")


def _parse_manifest(raw: bytes) -> tuple[str, wire.RankManifest, str | None]:
    """(text, manifest, what it contradicts in itself or None); 400 / 422 for bad input."""
    try:
        text = raw.decode("utf-8")
        manifest = wire.RankManifest.model_validate_json(text)
    except UnicodeDecodeError as exc:
        raise HTTPException(400, "body: manifest is not UTF-8") from exc
    except ValidationError as exc:
        raise HTTPException(422, _errors(exc)) from exc
    # stored as text, verbatim: an escaped NUL (\\u0000) is just six characters there; a raw one is no JSON
    return text, manifest, manifest.conflicts()


def _errors(exc: ValidationError) -> list[dict[str, Any]]:
    return [{"loc": ["body", *e["loc"]], "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
