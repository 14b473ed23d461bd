"""PlannerClient: the synchronous Python client of the planner's REST API (httpx).

Requests are built from and answers parsed into the wire types of `planner.contract.wire`, the same models the
server validates with, so a field has one definition on both sides.
"""

from __future__ import annotations

import base64
import contextlib
import copy
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from planner.contract import protocol
from planner.contract.errors import (
    AllBusy,
    AuthError,
    BadRequest,
    Conflict,
    NoSource,
    NotFound,
    PlannerError,
    PlannerUnavailable,
    ProtocolMismatch,
)
from planner.contract.views import (
    AnchorsPage,
    AnchorView,
    CompileCacheAnchorView,
    FleetView,
    InstancePage,
    ModelsPage,
    SharedPage,
    TransfersPage,
)
from planner.contract.wire import (
    AnchorUpload,
    Assignment,
    AssignmentRequest,
    CompileCacheAnchorUpload,
    CompileCacheReport,
    CompileCacheRequest,
    CompileCacheSources,
    HeartbeatAnswer,
    InstanceView,
    Labels,
    LeaseRenewal,
    ProgressReport,
    RankEndpoint,
    RankManifest,
    Registration,
    RegistrationRequest,
    ReportAnswer,
    SeededReport,
    SourceIdentity,
    StatusChange,
    TransferReport,
)

__all__ = [
    "AllBusy",
    "AuthError",
    "BadRequest",
    "Conflict",
    "NotFound",
    "PlannerClient",
    "PlannerError",
    "PlannerUnavailable",
    "ProtocolMismatch",
]

M = TypeVar("M", bound=BaseModel)


class PlannerClient:
    """Talks to one planner. Errors are PlannerError subclasses whose message names the op and field."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        # Plain http needs no TLS context (building the default one loads every CA: ~0.1-0.4 s).
        verify = not self.base_url.startswith("http://")
        # every request says which wire protocol it speaks (planner.contract.protocol)
        headers = {protocol.HEADER: str(protocol.PROTOCOL_VERSION)}
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, verify=verify, headers=headers)
        self._owns_http = True
        self._auth: dict[str, str] = {}
        self.use_token(token)

    def use_token(self, token: str | None) -> None:
        """Act with `token` from now on (None: no Authorization header)."""
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}

    def with_token(self, token: str | None) -> PlannerClient:
        """Another client over this one's connections (one pool per process), acting with `token`;
        closing it leaves the connections to this one."""
        other = copy.copy(self)
        other._owns_http = False
        other.use_token(token)
        return other

    def close(self) -> None:
        """Close the connection pool (unless it is another client's)."""
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> PlannerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- instances ---------------------------------------------------------------------------
    def register_instance(
        self,
        *,
        identity: SourceIdentity | Mapping[str, Any],
        labels: Mapping[str, str] | None = None,
        control_url: str | None = None,
        ranks: Sequence[RankEndpoint | Mapping[str, Any]] = (),
        max_concurrent_pulls: int = 2,
        control_key: str | None = None,
        compile_cache_keys: Sequence[str] = (),
    ) -> Registration:
        """Register an instance (INITIALIZING); ranks: RankEndpoint or {rank, provider, address (bytes or
        base64), backends}.

        `control_key` (hex, planner.contract.control_token.new_control_key) lets the planner sign
        per-assignment tokens for the instance's control endpoint; it is never shown back.
        """
        with _checked("register instance"):
            body = RegistrationRequest(
                identity=_identity(identity),
                labels=Labels(**dict(labels or {})),
                control_url=control_url,
                control_key=control_key,
                ranks=[_rank(r) for r in ranks],
                max_concurrent_pulls=max_concurrent_pulls,
                compile_cache_keys=list(compile_cache_keys),
            )
        return self._call("POST", "/v1/instances", "register instance", Registration, body=body)

    def get_instance(self, instance_id: str) -> InstanceView:
        """One instance's record."""
        return self._call("GET", f"/v1/instances/{instance_id}", f"get instance {instance_id}", InstanceView)

    def list_instances(self, **filters: Any) -> InstancePage:
        """One page of instances; filters: model, fingerprint, status, node, identity_key, limit, offset."""
        params = {k: v for k, v in filters.items() if v is not None}
        return self._call("GET", "/v1/instances", "list instances", InstancePage, params=params)

    def set_status(self, instance_id: str, status: str) -> InstanceView:
        """Move the instance along its lifecycle (Conflict on an illegal transition)."""
        op = f"set status of {instance_id}"
        with _checked(op):
            body = StatusChange(status=status)  # type: ignore[arg-type]
        return self._call("POST", f"/v1/instances/{instance_id}/status", op, InstanceView, body=body)

    def heartbeat(self, instance_id: str) -> HeartbeatAnswer:
        """The instance is alive; the answer says its status and how long until it turns STALE."""
        return self._call(
            "POST", f"/v1/instances/{instance_id}/heartbeat", f"heartbeat {instance_id}", HeartbeatAnswer
        )

    def delete_instance(self, instance_id: str) -> None:
        """Remove the instance."""
        self._call("DELETE", f"/v1/instances/{instance_id}", f"delete instance {instance_id}", None)

    def put_manifest(self, instance_id: str, rank: int, manifest: RankManifest | Mapping[str, Any]) -> None:
        """Publish the manifest of one global rank."""
        op = f"put manifest {instance_id} rank {rank}"
        with _checked(op):
            body = manifest if isinstance(manifest, RankManifest) else RankManifest.model_validate(manifest)
        self._call("PUT", f"/v1/instances/{instance_id}/manifests/{rank}", op, None, body=body)

    def get_manifest(self, instance_id: str, rank: int) -> RankManifest:
        """The manifest as published (a reader sees descriptors as "")."""
        op = f"get manifest {instance_id} rank {rank}"
        return self._call("GET", f"/v1/instances/{instance_id}/manifests/{rank}", op, RankManifest)

    # ---- assignments -------------------------------------------------------------------------
    def request_assignment(
        self,
        *,
        identity: SourceIdentity | Mapping[str, Any],
        rank: int,
        labels: Mapping[str, str] | None = None,
        providers: Sequence[str] = ("tcp",),
        backends: Sequence[str] = ("tcp", "nccl"),
        requester_id: str | None = None,
        exclude: Iterable[str] = (),
        fallback_s: float | None = None,
        serves_after: int = 0,
        waited_s: float = 0.0,
        raise_no_source: bool = False,
    ) -> Assignment | None:
        """Ranked candidates for `rank` with a lease on the first; None = no source (load from disk), or
        with `raise_no_source` the planner's NoSource, whose `anchored` says whether the rank has an anchor.

        Raises AllBusy(retry_after_s, expected_pull_s, fallback) when every source is at its pull
        limit; `fallback` is true when `fallback_s` (this requester's disk/hub estimate) beats waiting.
        """
        with _checked(f"request assignment rank {rank}"):
            body = AssignmentRequest(
                identity=_identity(identity),
                rank=rank,
                labels=Labels(**dict(labels or {})),
                providers=list(providers),
                backends=list(backends),
                requester_id=requester_id,
                exclude=list(exclude),
                fallback_s=fallback_s,
                serves_after=serves_after,
                waited_s=waited_s,
            )
        try:
            return self._call(
                "POST", "/v1/assignments", f"request assignment rank {rank}", Assignment, body=body
            )
        except NoSource:
            if raise_no_source:
                raise
            return None

    def compile_cache_sources(
        self,
        cache_key: str,
        *,
        identity_key: str,
        labels: Mapping[str, str] | None = None,
        exclude: Iterable[str] = (),
    ) -> CompileCacheSources | None:
        """The key's anchored archive digest and the READY instances of `identity_key` serving it, best
        evidence then nearest first, with fetch tokens, none of `exclude`; None = no source (compile).
        NotFound `not_anchored`: no authority set the key's digest for that identity."""
        op = f"compile cache sources {cache_key[:12]}"
        with _checked(op):
            body = CompileCacheRequest(
                identity_key=identity_key, labels=Labels(**dict(labels or {})), exclude=list(exclude)
            )
        try:
            path = f"/v1/compile-caches/{cache_key}/sources"
            return self._call("POST", path, op, CompileCacheSources, body=body)
        except NotFound as exc:
            if exc.reason == "no_source":
                return None
            raise

    def report_compile_cache(
        self, cache_key: str, instance_id: str, outcome: str, *, error: str | None = None
    ) -> None:
        """Report how a fetch of `cache_key` from `instance_id` went: "verified" or "failed"."""
        op = f"report compile cache {cache_key[:12]} from {instance_id}"
        with _checked(op):
            body = CompileCacheReport(
                instance_id=instance_id, outcome=outcome, error=error  # type: ignore[arg-type]
            )
        self._call("POST", f"/v1/compile-caches/{cache_key}/reports", op, None, body=body)

    def anchor_compile_cache(
        self,
        cache_key: str,
        archive_digest: str,
        *,
        key_variant: str,
        identity_key: str | None = None,
        replace: bool = False,
    ) -> CompileCacheAnchorView:
        """Set a compile-cache key's archive digest (an admin, or an anchor-role instance serving it);
        `key_variant` proves the key is the identity's (wire.compile_cache_key)."""
        op = f"anchor compile cache {cache_key[:12]}"
        with _checked(op):
            body = CompileCacheAnchorUpload(
                archive_digest=archive_digest,
                key_variant=key_variant,
                identity_key=identity_key,
                replace=replace,
            )
        path = f"/v1/compile-caches/{cache_key}/anchor"
        return self._call("PUT", path, op, CompileCacheAnchorView, body=body)

    def report_transfer(
        self,
        assignment_id: str,
        *,
        outcome: str,
        bytes: int = 0,
        seconds: float = 0.0,
        backend: str = "",
        reason: str | None = None,
        error: str | None = None,
    ) -> ReportAnswer:
        """End the lease with the pull's outcome and figures."""
        op = f"report assignment {assignment_id}"
        with _checked(op):
            body = TransferReport(
                outcome=outcome,  # type: ignore[arg-type]
                bytes=bytes,
                seconds=seconds,
                backend=backend,
                reason=reason,
                error=error,
            )
        return self._call("POST", f"/v1/assignments/{assignment_id}/report", op, ReportAnswer, body=body)

    def report_progress(self, assignment_id: str, *, bytes_done: int, bytes_total: int) -> None:
        """Bytes read so far of a live pull (the fleet page's live tree); its holder only."""
        op = f"report progress of assignment {assignment_id}"
        with _checked(op):
            body = ProgressReport(bytes_done=bytes_done, bytes_total=bytes_total)
        self._call("POST", f"/v1/assignments/{assignment_id}/progress", op, None, body=body)

    def report_seeded(self, assignment_id: str, instance_id: str) -> None:
        """Say which instance now serves what a successful pull read (links the fan-out tree)."""
        op = f"report seeded of assignment {assignment_id}"
        with _checked(op):
            body = SeededReport(instance_id=instance_id)
        self._call("POST", f"/v1/assignments/{assignment_id}/seeded", op, None, body=body)

    def renew_assignment(self, assignment_id: str) -> LeaseRenewal:
        """Keep a live lease for another lease TTL (a long pull; Conflict once it has ended)."""
        op = f"renew assignment {assignment_id}"
        return self._call("POST", f"/v1/assignments/{assignment_id}/renew", op, LeaseRenewal)

    # ---- anchors (admin) ---------------------------------------------------------------------
    def put_anchor(self, body: AnchorUpload | Mapping[str, Any]) -> AnchorView:
        """Set (or replace) an identity's rank anchor from a checkpoint's digests (`rfork digest` bodies)."""
        with _checked("put anchor"):
            upload = body if isinstance(body, AnchorUpload) else AnchorUpload.model_validate(body)
        return self._call("PUT", "/v1/anchors", f"put anchor rank {upload.rank}", AnchorView, body=upload)

    def list_anchors(
        self, *, identity_key: str | None = None, limit: int = 1000, offset: int = 0
    ) -> AnchorsPage:
        """One page of anchors, oldest first (optionally of one identity)."""
        params = {
            "limit": limit,
            "offset": offset,
            **({"identity_key": identity_key} if identity_key else {}),
        }
        return self._call("GET", "/v1/anchors", "list anchors", AnchorsPage, params=params)

    def shared_identities(
        self, identity_key: str, *, rank: int, checksum_algorithm: str, limit: int = 10
    ) -> SharedPage:
        """Identities with READY instances whose anchor shares tensors with this one's, most first."""
        params = {"rank": rank, "checksum_algorithm": checksum_algorithm, "limit": limit}
        op = f"shared identities of {identity_key[:12]} rank {rank}"
        return self._call("GET", f"/v1/identities/{identity_key}/shared", op, SharedPage, params=params)

    def revoke_anchor(self, identity_key: str, rank: int, checksum_algorithm: str) -> None:
        """Revoke an anchor: nobody serves that rank until one is set again (NotFound if there is none)."""
        op = f"revoke anchor {identity_key[:12]} rank {rank}"
        self._call("DELETE", f"/v1/anchors/{identity_key}/{rank}/{checksum_algorithm}", op, None)

    # ---- views -------------------------------------------------------------------------------
    def models(self) -> ModelsPage:
        """Identities with their instance and READY counts."""
        return self._call("GET", "/v1/models", "list models", ModelsPage)

    def fleet(self) -> FleetView:
        """What the fleet page shows: identities, instances, the fan-out tree, transfers, refusals."""
        return self._call("GET", "/v1/fleet", "fleet view", FleetView)

    def transfers(self, **filters: Any) -> TransfersPage:
        """One page of finished assignments; filters: seed_id, outcome, limit, offset."""
        params = {k: v for k, v in filters.items() if v is not None}
        return self._call("GET", "/v1/transfers", "list transfers", TransfersPage, params=params)

    def _call(
        self,
        method: str,
        path: str,
        op: str,
        answer: type[M] | None,
        *,
        body: BaseModel | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> Any:
        """One request; the answer parsed as `answer` (None: no body expected), or a PlannerError."""
        content = body.model_dump_json().encode() if body is not None else None
        headers = {**self._auth, "Content-Type": "application/json"} if content is not None else self._auth
        try:
            resp = self._http.request(method, path, content=content, headers=headers, params=params)
        except httpx.HTTPError as exc:
            raise PlannerUnavailable(f"{op}: planner at {self.base_url} unreachable: {exc}") from exc
        if resp.status_code < 300:
            return None if answer is None else answer.model_validate_json(resp.content)
        raise _error(op, resp)


@contextlib.contextmanager
def _checked(op: str) -> Iterator[None]:
    """A request the wire type refuses fails here, as BadRequest naming the field (nothing is sent)."""
    try:
        yield
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise BadRequest(f"{op}: {where}: {first.get('msg')}", reason="invalid_request") from exc


def _identity(identity: SourceIdentity | Mapping[str, Any]) -> SourceIdentity:
    return identity if isinstance(identity, SourceIdentity) else SourceIdentity.model_validate(identity)


def _rank(r: RankEndpoint | Mapping[str, Any]) -> RankEndpoint:
    if isinstance(r, RankEndpoint):
        return r
    row = dict(r)
    addr = row.get("address", b"")
    if isinstance(addr, (bytes, bytearray, memoryview)):
        row["address"] = base64.b64encode(bytes(addr)).decode()
    row.setdefault("backends", [row.get("provider", "tcp")])
    return RankEndpoint.model_validate(row)


def _error(op: str, resp: httpx.Response) -> PlannerError:
    """The PlannerError for a non-2xx answer, its message naming the op and what the planner said."""
    try:
        payload = resp.json()
    except ValueError:
        payload = {"detail": resp.text[:500]}
    if not isinstance(payload, dict):
        payload = {"detail": payload}
    detail = payload.get("message") or payload.get("detail") or resp.reason_phrase
    msg = f"{op}: {resp.status_code} {detail}"
    reason = payload.get("reason")
    code = resp.status_code
    if code == 429:
        pull = payload.get("expected_pull_s")
        return AllBusy(
            msg,
            retry_after_s=float(payload.get("retry_after_s") or 1.0),
            expected_pull_s=float(pull) if isinstance(pull, (int, float)) else None,
            fallback=payload.get("fallback") is True,
        )
    cls: type[PlannerError]
    if code in (401, 403):
        cls = AuthError
    elif code == 404 and reason == "no_source":
        return NoSource(msg, anchored=payload.get("anchored") is not False)
    elif code == 404:
        cls = NotFound
    elif code == 409:
        cls = Conflict
    elif code == 400 and reason == protocol.REASON:
        cls = ProtocolMismatch
    elif code in (400, 413, 422):
        cls = BadRequest
    elif code >= 500:
        cls = PlannerUnavailable
    else:
        cls = PlannerError
    return cls(msg, status=code, reason=reason)
