"""Pulling a rank over the NCCL/gloo fallback: ask the seed's control endpoint for a session, receive
the tensors in manifest order (backends.nccl), then verify every digest."""

from __future__ import annotations

import http
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from backends.nccl import (
    DEFAULT_MAX_IN_FLIGHT,
    BucketCallback,
    NcclSetupError,
    NcclTransferError,
    backend_for,
    connect_rendezvous,
    local_address_towards,
    recv_tensors,
)
from planner.contract import Candidate, seed_http
from rfork.errors import PullError
from rfork.pull.read_plan import ReadPlan
from rfork.seed_networks import SeedNetworkRefused, resolve_seed_host

logger = logging.getLogger(__name__)

SESSION_ANSWER_MAX_BYTES = 16 << 10  # {"session_id", "host", "port", "backend"}: a few hundred bytes


class NcclSessionError(NcclSetupError):
    """The seed's control endpoint refused or failed the session request; ``status`` is the HTTP code."""

    def __init__(
        self, message: str, *, status: int | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


def request_session(
    control_url: str, rank: int, *, timeout_s: float, control_token: str | None = None
) -> dict[str, Any]:
    """POST /v1/nccl/sessions (with the lease's control token); the seed's JSON answer or NcclSessionError.

    The whole answer must arrive within ``timeout_s`` (a total deadline, not per read) and its body
    within SESSION_ANSWER_MAX_BYTES: a seed that drips or floods its answer fails the request in time.
    """
    url = control_url.rstrip("/") + "/v1/nccl/sessions"
    headers = {"Content-Type": "application/json"}
    if control_token:
        headers["Authorization"] = f"Bearer {control_token}"
    try:
        answer = seed_http.exchange(
            url,
            method="POST",
            body=json.dumps({"rank": rank}).encode(),
            headers=headers,
            deadline_s=timeout_s,
            max_body_bytes=SESSION_ANSWER_MAX_BYTES,
            resolve=resolve_seed_host,  # RFORK_SEED_NETWORKS, when set
        )
    except (seed_http.SeedHttpError, SeedNetworkRefused) as exc:
        raise NcclSessionError(
            f"seed {control_url} unreachable for an nccl session (rank {rank}): {exc}"
        ) from exc
    try:
        body = json.loads(answer.body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if answer.status >= 400:
        detail = body if isinstance(body, dict) else {}
        retry = detail.get("retry_after_s")
        msg = detail.get("error")
        raise NcclSessionError(
            f"seed {control_url} refused an nccl session for rank {rank}: "
            f"HTTP {answer.status} {msg or _reason(answer.status)}",
            status=answer.status,
            retry_after_s=float(retry) if isinstance(retry, (int, float)) else None,
        )
    if not _is_session(body):
        raise NcclSessionError(f"seed {control_url} answered an unexpected session body: {body!r:.200}")
    assert isinstance(body, dict)
    return body


def _is_session(body: Any) -> bool:
    """A session answer: string id, host and backend, a TCP port."""
    return (
        isinstance(body, dict)
        and all(isinstance(body.get(k), str) and body[k] for k in ("session_id", "host", "backend"))
        and type(body.get("port")) is int
        and 0 < body["port"] < 65536
    )


def _reason(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "error"


def pull_over_nccl(
    control_url: str,
    rank: int,
    dest_tensors: Sequence[torch.Tensor],
    *,
    timeout_s: float,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    on_bucket: BucketCallback | None = None,
    control_token: str | None = None,
) -> int:
    """Fill ``dest_tensors`` (rank ``rank``'s tensors in manifest order) from the seed; returns bytes.

    ``timeout_s`` bounds every phase (session request, rendezvous, group setup, each bucket).
    Raises ``backends.nccl.NcclTransferError`` subclasses: NcclSessionError (HTTP refusal; status 429
    means the seed is busy), NcclSetupError, NcclTimeoutError, NcclPeerError (seed died),
    NcclPlanMismatchError. A failed pull may leave ``dest_tensors`` partly written.
    """
    want = backend_for(dest_tensors)
    t0 = time.perf_counter()
    session = request_session(control_url, rank, timeout_s=timeout_s, control_token=control_token)
    if session["backend"] != want:
        raise NcclSetupError(
            f"seed {control_url} offers backend {session['backend']!r} for rank {rank}, "
            f"destination tensors need {want!r}"
        )
    host, port, sid = str(session["host"]), int(session["port"]), str(session["session_id"])
    try:  # the session host a seed names is held to RFORK_SEED_NETWORKS like its control URL
        address = resolve_seed_host(host, port)[0][0]
    except OSError as exc:  # outside the networks (SeedNetworkRefused), or it does not resolve
        why = f"seed {control_url} named session host {host} for rank {rank}: {exc}"
        raise NcclSessionError(why) from exc
    store = connect_rendezvous(address, port, timeout_s=timeout_s)
    peer = f"seed {host}:{port} rank {rank} (session {sid[:8]})"
    try:
        n = recv_tensors(
            store,
            dest_tensors,
            session_id=sid,
            local_host=local_address_towards(host),
            timeout_s=timeout_s,
            peer=peer,
            max_in_flight=max_in_flight,
            on_bucket=on_bucket,
        )
    except NcclTransferError:
        logger.warning(
            "nccl pull of rank %d from %s failed after %.2fs", rank, control_url, time.perf_counter() - t0
        )
        raise
    logger.info(
        "nccl pull of rank %d: %d bytes in %.3fs from %s", rank, n, time.perf_counter() - t0, control_url
    )
    return n


def pull_nccl(candidate: Candidate, plan: ReadPlan, *, timeout_s: float) -> None:
    """Fill the plan's destination from the leased seed over NCCL/gloo (bounded by `timeout_s` per
    phase), then verify every tensor: the seed streams them whole, in manifest order."""
    if not candidate.control_url:
        raise PullError(f"seed {candidate.instance_id} publishes no control endpoint for the NCCL fallback")
    pull_over_nccl(
        candidate.control_url,
        plan.rank,
        plan.streamed(),
        timeout_s=timeout_s,
        control_token=candidate.control_token,
    )
    plan.accept_all()
