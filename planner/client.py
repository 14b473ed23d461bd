"""PlannerClient: the synchronous Python client of the planner's REST API (httpx)."""

from __future__ import annotations

import base64
import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from planner.errors import (
    AllBusy,
    AuthError,
    BadRequest,
    Conflict,
    NotFound,
    PlannerError,
    PlannerUnavailable,
)

__all__ = [
    "AllBusy",
    "Assignment",
    "AuthError",
    "BadRequest",
    "Candidate",
    "Conflict",
    "NotFound",
    "PlannerClient",
    "PlannerError",
    "PlannerUnavailable",
    "Registration",
]


@dataclass(frozen=True)
class Registration:
    """A registered instance: its id and the bearer token scoped to it."""

    id: str
    token: str
    status: str
    identity_key: str
    raw: dict[str, Any] = field(repr=False, default_factory=dict)


@dataclass(frozen=True)
class Candidate:
    """One source for a rank: where to pull from, how, and what (its manifest)."""

    instance_id: str
    rank: int
    provider: str
    address: bytes
    backends: list[str]
    control_url: str | None
    labels: dict[str, str]
    manifest: dict[str, Any] = field(repr=False)
    # the identity's anchored digest set for this rank: {checksum_algorithm, digest_set, instance_id}
    anchor: dict[str, Any] | None = None
    control_token: str | None = field(default=None, repr=False)  # for the leased candidate's control endpoint


@dataclass(frozen=True)
class Assignment:
    """A lease on `candidates[0]` (the others are unleased alternatives) until `expires_at`."""

    id: str
    expires_at: dt.datetime
    candidates: list[Candidate]


class PlannerClient:
    """Talks to one planner. Errors are PlannerError subclasses whose message names the op and field."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        # Plain http needs no TLS context (building the default one loads every CA: ~0.1-0.4 s).
        verify = not self.base_url.startswith("http://")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, verify=verify)
        self.use_token(token)

    def use_token(self, token: str | None) -> None:
        """Act with `token` from now on (None: no Authorization header)."""
        self._http.headers.pop("Authorization", None)
        if token:
            self._http.headers["Authorization"] = f"Bearer {token}"

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> PlannerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- instances ---------------------------------------------------------------------------
    def register_instance(
        self,
        *,
        identity: Mapping[str, Any],
        labels: Mapping[str, str] | None = None,
        control_url: str | None = None,
        ranks: Sequence[Mapping[str, Any]] = (),
        max_concurrent_pulls: int = 2,
        control_key: str | None = None,
    ) -> Registration:
        """Register an instance (INITIALIZING); ranks: {rank, provider, address (bytes or b64), backends}.

        `control_key` (hex, planner.control_token.new_control_key) lets the planner sign per-assignment
        tokens for the instance's control endpoint; it is never shown back.
        """
        body = {
            "identity": dict(identity),
            "labels": dict(labels or {}),
            "control_url": control_url,
            "control_key": control_key,
            "ranks": [_rank_json(r) for r in ranks],
            "max_concurrent_pulls": max_concurrent_pulls,
        }
        data = self._call("POST", "/v1/instances", "register instance", json=body)
        return Registration(
            id=data["id"],
            token=data["token"],
            status=data["status"],
            identity_key=data["identity_key"],
            raw=data,
        )

    def get_instance(self, instance_id: str) -> dict[str, Any]:
        """One instance's record."""
        return dict(self._call("GET", f"/v1/instances/{instance_id}", f"get instance {instance_id}"))

    def list_instances(self, **filters: Any) -> dict[str, Any]:
        """`{items, total}`; filters: model, fingerprint, status, node, identity_key, limit, offset."""
        params = {k: v for k, v in filters.items() if v is not None}
        return dict(self._call("GET", "/v1/instances", "list instances", params=params))

    def set_status(self, instance_id: str, status: str) -> dict[str, Any]:
        """Move the instance along its lifecycle (Conflict on an illegal transition)."""
        return dict(
            self._call(
                "POST",
                f"/v1/instances/{instance_id}/status",
                f"set status of {instance_id}",
                json={"status": status},
            )
        )

    def heartbeat(self, instance_id: str) -> dict[str, Any]:
        """`{status, ttl_s}`."""
        return dict(self._call("POST", f"/v1/instances/{instance_id}/heartbeat", f"heartbeat {instance_id}"))

    def delete_instance(self, instance_id: str) -> None:
        """Remove the instance."""
        self._call("DELETE", f"/v1/instances/{instance_id}", f"delete instance {instance_id}")

    def put_manifest(self, instance_id: str, rank: int, manifest: Mapping[str, Any]) -> None:
        """Publish the manifest of one global rank."""
        self._call(
            "PUT",
            f"/v1/instances/{instance_id}/manifests/{rank}",
            f"put manifest {instance_id} rank {rank}",
            json=dict(manifest),
        )

    def get_manifest(self, instance_id: str, rank: int) -> dict[str, Any]:
        """The manifest as published."""
        return dict(
            self._call(
                "GET",
                f"/v1/instances/{instance_id}/manifests/{rank}",
                f"get manifest {instance_id} rank {rank}",
            )
        )

    # ---- assignments -------------------------------------------------------------------------
    def request_assignment(
        self,
        *,
        identity: Mapping[str, Any],
        rank: int,
        labels: Mapping[str, str] | None = None,
        providers: Sequence[str] = ("tcp",),
        backends: Sequence[str] = ("tcp", "nccl"),
        requester_id: str | None = None,
        exclude: Iterable[str] = (),
        fallback_s: float | None = None,
        serves_after: int = 0,
        waited_s: float = 0.0,
    ) -> Assignment | None:
        """Ranked candidates for `rank` with a lease on the first; None = no source (load from disk).

        Raises AllBusy(retry_after_s, expected_pull_s, fallback) when every source is at its pull
        limit; `fallback` is true when `fallback_s` (this requester's disk/hub estimate) beats waiting.
        """
        body = {
            "identity": dict(identity),
            "rank": rank,
            "labels": dict(labels or {}),
            "providers": list(providers),
            "backends": list(backends),
            "requester_id": requester_id,
            "exclude": list(exclude),
        }
        if fallback_s is not None:
            body["fallback_s"] = fallback_s
        if serves_after:
            body["serves_after"] = serves_after
        if waited_s > 0:
            body["waited_s"] = waited_s
        try:
            data = self._call("POST", "/v1/assignments", f"request assignment rank {rank}", json=body)
        except NotFound as exc:
            if exc.reason == "no_source":
                return None
            raise
        return Assignment(
            id=data["id"],
            expires_at=dt.datetime.fromisoformat(data["expires_at"]),
            candidates=[
                Candidate(
                    instance_id=c["instance_id"],
                    rank=c["rank"],
                    provider=c["provider"],
                    address=base64.b64decode(c["address"]),
                    backends=list(c["backends"]),
                    control_url=c["control_url"],
                    labels=dict(c["labels"]),
                    manifest=c["manifest"],
                    anchor=c.get("anchor"),
                    control_token=c.get("control_token"),
                )
                for c in data["candidates"]
            ],
        )

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
    ) -> dict[str, Any]:
        """End the lease with the pull's outcome and figures."""
        body = {
            "outcome": outcome,
            "bytes": bytes,
            "seconds": seconds,
            "backend": backend,
            "reason": reason,
            "error": error,
        }
        return dict(
            self._call(
                "POST",
                f"/v1/assignments/{assignment_id}/report",
                f"report assignment {assignment_id}",
                json=body,
            )
        )

    # ---- views -------------------------------------------------------------------------------
    def models(self) -> list[dict[str, Any]]:
        """Identities with their READY counts."""
        return list(self._call("GET", "/v1/models", "list models")["items"])

    def transfers(self, **filters: Any) -> dict[str, Any]:
        """`{items, total}` of finished assignments."""
        params = {k: v for k, v in filters.items() if v is not None}
        return dict(self._call("GET", "/v1/transfers", "list transfers", params=params))

    def _call(self, method: str, path: str, op: str, **kwargs: Any) -> Any:
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise PlannerUnavailable(f"{op}: planner at {self.base_url} unreachable: {exc}") from exc
        if resp.status_code < 300:
            return resp.json() if resp.content else None
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
            raise AllBusy(
                msg,
                retry_after_s=float(payload.get("retry_after_s") or 1.0),
                expected_pull_s=float(pull) if isinstance(pull, (int, float)) else None,
                fallback=payload.get("fallback") is True,
            )
        cls: type[PlannerError]
        if code in (401, 403):
            cls = AuthError
        elif code == 404:
            cls = NotFound
        elif code == 409:
            cls = Conflict
        elif code in (400, 413, 422):
            cls = BadRequest
        elif code >= 500:
            cls = PlannerUnavailable
        else:
            cls = PlannerError
        raise cls(msg, status=code, reason=reason)


def _rank_json(r: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(r)
    addr = out.get("address", b"")
    if isinstance(addr, (bytes, bytearray, memoryview)):
        out["address"] = base64.b64encode(bytes(addr)).decode()
    out.setdefault("backends", [out.get("provider", "tcp")])
    return out
