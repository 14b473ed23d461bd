"""A seed's HTTP control endpoint: loaders ask it for an NCCL/gloo session and it streams in the background.

Endpoints (JSON):
  GET  /v1/health                    -> 200 {"status": "ok", "active_sessions", "max_concurrent", ...}
  POST /v1/nccl/sessions {"rank": r} -> 201 {"session_id", "host", "port", "backend"}; a worker thread
                                        then sends ``tensors_for_rank(r)`` as group rank 0. With a
                                        ``control_key``, only for ``Authorization: Bearer <token>``
                                        where the token is the planner-issued per-assignment secret
                                        (planner.contract.control_token): 401 without one, 403 for a bad,
                                        expired, replayed or other-rank token.
  GET  /v1/nccl/sessions/{id}        -> 200 {"session_id", "rank", "state", "bytes", "error"}
  GET  /v1/compile-caches/{key}      -> 200 the compile cache's tar (rfork.compile_cache.archive), its
                                        digest in ``X-Rfork-Archive-Digest`` (informational: loaders
                                        check the planner's anchored digest); only for a planner-issued
                                        compile-cache token of that key (issue_compile_cache in
                                        planner.contract.control_token), spent by one fetch; it opens
                                        no NCCL session. 404: not a key of this seed; 409: nothing compiled
                                        yet, or still being written.
Bad input answers 4xx with {"error": message}; a full seed answers 429 {"reason": "busy", ...}.
Requests are parsed and bounded in `rfork.seed.control_http`; this module decides what they mean.

Thread-safety: the HTTP server (one asyncio thread plus ``http_workers`` threads that open sessions)
and every session run on their own threads; the sends release the
GIL while data moves, so the seed's other threads (heartbeats, this endpoint) keep answering.
Each session has its own rendezvous port (from the OS) and group-name prefix, so concurrent
loaders never collide. A loader that vanishes fails its session within ``timeout_s``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import torch

from backends.nccl import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_MAX_IN_FLIGHT,
    NcclTransferError,
    Rendezvous,
    backend_for,
    send_tensors,
)
from planner.contract import ControlGrant, ControlTokenError, claimed_rank, verify_control_token
from rfork.compile_cache.archive import CompileCacheError, PackedCache
from rfork.compile_cache.shelf import CacheNotReady, CacheShelf
from rfork.seed.control_http import ControlHttpServer, HttpError

logger = logging.getLogger(__name__)

TensorsForRank = Callable[[int], Sequence[torch.Tensor]]
_HISTORY = 256


@dataclass
class SessionInfo:
    """One loader's session as the seed sees it. ``state``: waiting → sending → done | failed."""

    session_id: str
    rank: int
    backend: str
    port: int
    state: str = "waiting"
    bytes: int = 0
    error: str | None = None
    started_at: float = 0.0
    finished_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "rank": self.rank,
            "backend": self.backend,
            "port": self.port,
            "state": self.state,
            "bytes": self.bytes,
            "error": self.error,
            "seconds": None if self.finished_at is None else self.finished_at - self.started_at,
        }


class ControlServer:
    """The seed's control endpoint (rfork.seed.control_http's bounded server on a background thread).

    ``tensors_for_rank(r)`` returns rank r's tensors in manifest order (it may raise LookupError for
    an unknown rank → 404). At most ``max_concurrent`` sessions run at once (429 beyond). Every phase
    of a session (rendezvous, each bucket) is bounded by ``timeout_s``.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tensors_for_rank: TensorsForRank,
        max_concurrent: int = 2,
        timeout_s: float = 30.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        control_key: str | None = None,
        instance_ids: Callable[[], Sequence[str]] | None = None,
        request_timeout_s: float = 10.0,
        http_workers: int = 4,
        compile_caches: CacheShelf | None = None,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        self.host = host
        self.tensors_for_rank = tensors_for_rank
        self.max_concurrent = max_concurrent
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.max_in_flight = max_in_flight
        self.control_key = control_key
        self.instance_ids = instance_ids or (lambda: ())
        self.request_timeout_s = request_timeout_s
        self.http_workers = http_workers
        self.compile_caches = compile_caches
        self._used_leases: dict[str, float] = {}  # lease id -> expiry: one session per lease
        self._port = port
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, SessionInfo] = OrderedDict()
        self._workers: dict[str, threading.Thread] = {}
        self._active = 0
        self._served = 0
        self._failed = 0
        self._httpd: ControlHttpServer | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> ControlServer:
        """Bind and serve on background threads; returns self (``ControlServer(...).start()`` reads well)."""
        if self._httpd is not None:
            raise RuntimeError("ControlServer already started")
        httpd = ControlHttpServer(
            self, host=self.host, port=self._port, request_deadline_s=self.request_timeout_s,
            workers=self.http_workers,
        )
        httpd.start()
        self._httpd = httpd
        logger.info("control endpoint on %s", self.url)
        return self

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        if self._httpd is None:
            raise RuntimeError("ControlServer not started")
        host, port = self._httpd.address
        return f"http://{host}:{port}"

    def close(self, join_timeout_s: float = 5.0) -> None:
        """Stop answering; wait up to ``join_timeout_s`` for running sessions (they end within timeout_s)."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.close(join_timeout_s)
        deadline = time.monotonic() + join_timeout_s
        with self._lock:
            workers = list(self._workers.values())
        for w in workers:
            w.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> ControlServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- state -------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        httpd = self._httpd
        with self._lock:
            return {
                "status": "ok",
                "active_sessions": self._active,
                "max_concurrent": self.max_concurrent,
                "sessions_served": self._served,
                "sessions_failed": self._failed,
                "open_connections": httpd.open_connections() if httpd is not None else 0,
                "evicted_connections": httpd.evicted if httpd is not None else 0,
            }

    def session(self, session_id: str) -> SessionInfo | None:
        with self._lock:
            return self._sessions.get(session_id)

    def authorize(self, authorization: str | None) -> ControlGrant | None:
        """Check the planner-issued token from the headers alone (None without a control_key).

        Runs before the body is read: signature, instance, expiry and an unused lease. The rank the
        token names is checked against the body's in ``open_session``, which also spends the lease.
        """
        if self.control_key is None:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise HttpError(
                HTTPStatus.UNAUTHORIZED, "Authorization: a per-assignment bearer token is required"
            )
        rank = claimed_rank(token)
        try:
            grant = verify_control_token(
                token, self.control_key, instance_ids=self.instance_ids(), rank=-1 if rank is None else rank,
                now=time.time(),
            )
        except ControlTokenError as exc:
            raise HttpError(HTTPStatus.FORBIDDEN, str(exc)) from exc
        with self._lock:
            self._check_lease_unused(grant.lease_id)
        return grant

    def _check_lease_unused(self, lease_id: str) -> None:
        now = time.time()
        for lease, expiry in list(self._used_leases.items()):
            if expiry < now:
                del self._used_leases[lease]
        if lease_id in self._used_leases:
            raise HttpError(HTTPStatus.FORBIDDEN, f"control token: lease {lease_id} was already used")

    def _spend(self, grant: ControlGrant | None, rank: int) -> None:
        """One session per lease, for the rank its token names."""
        if grant is None:
            return
        if grant.compile_cache:
            raise HttpError(HTTPStatus.FORBIDDEN, "control token: a compile-cache grant opens no session")
        if grant.rank != rank:
            raise HttpError(
                HTTPStatus.FORBIDDEN, f"control token: issued for rank {grant.rank}, not rank {rank}"
            )
        with self._lock:
            self._check_lease_unused(grant.lease_id)
            self._used_leases[grant.lease_id] = grant.expires_at

    def compile_cache(self, grant: ControlGrant | None, key: str) -> PackedCache:
        """The archive of compile cache `key` for a compile-cache grant of that key, spent by the fetch that
        gets it (one per grant): a fetch answered 404, 409 not_ready or 507 leaves the grant unspent, so
        the loader may ask again once the cache settled. May block: it may pack."""
        if grant is not None and not grant.compile_cache:
            raise HttpError(HTTPStatus.FORBIDDEN, "control token: not a compile-cache grant")
        if grant is not None and grant.cache_key != key:
            raise HttpError(HTTPStatus.FORBIDDEN, f"control token: not a grant for compile cache {key[:12]}")
        if grant is not None:  # held while this fetch runs (a second use of it meanwhile is refused)
            with self._lock:
                self._check_lease_unused(grant.lease_id)
                self._used_leases[grant.lease_id] = grant.expires_at
        try:
            return self._archive(key)
        except HttpError:
            if grant is not None:  # nothing was served: the grant stays good for another try
                with self._lock:
                    self._used_leases.pop(grant.lease_id, None)
            raise

    def _archive(self, key: str) -> PackedCache:
        """The packed archive of `key`; HttpError 404 (none here), 409 not_ready, 507 (cannot pack)."""
        if self.compile_caches is None:
            raise HttpError(HTTPStatus.NOT_FOUND, "this seed serves no compile caches")
        try:
            return self.compile_caches.archive(key)
        except LookupError as exc:
            raise HttpError(HTTPStatus.NOT_FOUND, f"no compile cache {key[:12]} on this seed") from exc
        except CacheNotReady as exc:
            raise HttpError(HTTPStatus.CONFLICT, str(exc), reason="not_ready") from exc
        except CompileCacheError as exc:
            raise HttpError(HTTPStatus.INSUFFICIENT_STORAGE, str(exc)) from exc

    def open_session(self, grant: ControlGrant | None, rank: int, local_host: str) -> SessionInfo:
        """Spend the grant, validate the rank, reserve a slot, open a rendezvous port, start the sender."""
        self._spend(grant, rank)
        try:
            tensors = list(self.tensors_for_rank(rank))
        except (LookupError, ValueError) as exc:
            raise HttpError(HTTPStatus.NOT_FOUND, f"rank {rank} is not served by this seed: {exc}") from exc
        try:
            backend = backend_for(tensors)
        except NcclTransferError as exc:
            raise HttpError(HTTPStatus.CONFLICT, str(exc)) from exc
        with self._lock:
            if self._active >= self.max_concurrent:
                raise HttpError(
                    HTTPStatus.TOO_MANY_REQUESTS,
                    f"seed busy: {self._active} of {self.max_concurrent} sessions running",
                    reason="busy",
                    retry_after_s=1.0,
                )
            self._active += 1
        try:
            rdv = Rendezvous(host=local_host, timeout_s=self.timeout_s)
        except NcclTransferError as exc:
            with self._lock:
                self._active -= 1
            raise HttpError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc)) from exc
        info = SessionInfo(
            session_id=uuid.uuid4().hex,
            rank=rank,
            backend=backend,
            port=rdv.port,
            started_at=time.monotonic(),
        )
        worker = threading.Thread(
            target=self._run_session,
            args=(info, rdv, tensors, local_host),
            name=f"rfork-nccl-send-{info.session_id[:8]}",
            daemon=True,
        )
        with self._lock:
            self._sessions[info.session_id] = info
            while len(self._sessions) > _HISTORY:
                old, _ = self._sessions.popitem(last=False)
                self._workers.pop(old, None)
            self._workers[info.session_id] = worker
        worker.start()
        return info

    def _run_session(
        self, info: SessionInfo, rdv: Rendezvous, tensors: list[torch.Tensor], local_host: str
    ) -> None:
        peer = f"loader of rank {info.rank} (session {info.session_id[:8]})"

        def progress(index: int, moved: int) -> None:
            del index
            info.state = "sending"
            info.bytes = moved

        try:
            assert rdv.store is not None
            info.bytes = send_tensors(
                rdv.store,
                tensors,
                session_id=info.session_id,
                local_host=local_host,
                timeout_s=self.timeout_s,
                peer=peer,
                bucket_bytes=self.bucket_bytes,
                max_in_flight=self.max_in_flight,
                on_bucket=progress,
            )
            info.state = "done"
            logger.info("session %s: sent %d bytes of rank %d", info.session_id, info.bytes, info.rank)
        except NcclTransferError as exc:
            info.state = "failed"
            info.error = str(exc)
            logger.warning("session %s failed: %s", info.session_id, exc)
        finally:
            rdv.close()
            info.finished_at = time.monotonic()
            with self._lock:
                self._active -= 1
                if info.state == "done":
                    self._served += 1
                else:
                    if info.state != "failed":
                        info.state = "failed"
                        info.error = info.error or "worker ended unexpectedly"
                    self._failed += 1
                self._workers.pop(info.session_id, None)
