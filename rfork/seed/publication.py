"""A seed's publication at the planner: register, put manifests, set READY, heartbeat, drain on close.

It keeps itself published: a heartbeat answered STALE sets the status again; a planner that forgot
the instance (404, or 401 for its instance token: a new database) registers it again from scratch.
With `retry=True` a planner that cannot be reached at first is retried in the background, while the
weights stay served.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import urlsplit

from planner.contract import (
    AuthError,
    InstanceStatus,
    NotFound,
    PlannerClient,
    PlannerUnavailable,
    RankEndpoint,
    RankManifest,
)
from rfork import metrics
from rfork.compile_cache.anchor import CacheAnchoring
from rfork.identity import SourceIdentity, default_labels

log = logging.getLogger(__name__)


def routable_host(planner_url: str) -> str:
    """$RFORK_CONTROL_HOST, else this host's address on the route towards the planner (never 0.0.0.0)."""
    configured = os.environ.get("RFORK_CONTROL_HOST")
    if configured:
        return configured
    target = urlsplit(planner_url).hostname or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(target), 9))  # UDP: no packet is sent
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class Publication:
    """One planner instance: register, manifests, READY, heartbeat thread, DRAINING + delete on close.

    It keeps itself published: a heartbeat answered STALE sets READY again; a 404 (the planner lost
    it, e.g. a new database) registers again from scratch. With `retry=True` a planner that cannot be
    reached at first is retried in the background (the weights stay served meanwhile).
    """

    def __init__(
        self,
        *,
        planner_url: str,
        token: str | None,
        identity: SourceIdentity,
        ranks: Sequence[RankEndpoint],
        manifests: Mapping[int, RankManifest],
        labels: Mapping[str, str] | None = None,
        control_url: str | None = None,
        control_key: str | None = None,
        compile_cache_keys: Sequence[str] = (),
        anchoring: CacheAnchoring | None = None,
        max_concurrent_pulls: int = 2,
        status: str = "READY",
        retry: bool = False,
        retry_interval_s: float = 2.0,
        on_heartbeat_error: Callable[[Exception], None] | None = None,
        rehash: Callable[[], Mapping[int, RankManifest]] | None = None,
        client: PlannerClient | None = None,
    ) -> None:
        """`client`: share this client's connections (a loader's) instead of opening a second pool.
        `anchoring`: publishes the compile caches' archive digests from the heartbeat thread."""
        self.client = PlannerClient(planner_url, token=token) if client is None else client.with_token(token)
        self._register_token = token
        self._identity = identity
        self._ranks = list(ranks)
        self._manifests = dict(manifests)
        self._labels = dict(labels or default_labels())
        self._control_url = control_url
        self._control_key = control_key
        self._compile_cache_keys = list(compile_cache_keys)
        self._anchoring = anchoring
        self._identity_key = ""
        self._max_pulls = max_concurrent_pulls
        self._status = status
        self._retry_interval_s = retry_interval_s
        self._lock = threading.Lock()
        self.instance_id: str | None = None
        self.instance_token: str | None = None  # acts as this instance only (set on registering)
        self._stop = threading.Event()
        self._on_error = on_heartbeat_error
        self._rehash = rehash
        self._closed = False
        try:
            self._publish()
        except PlannerUnavailable as exc:
            if not retry:
                self.client.close()
                raise
            log.warning(
                "planner unreachable (%s); publishing in the background every %.1f s", exc, retry_interval_s
            )
        except BaseException:
            self.client.close()
            raise
        self._thread = threading.Thread(target=self._beat, name="rfork-heartbeat", daemon=True)
        self._thread.start()

    @property
    def published(self) -> bool:
        """True once the planner knows this instance (False while retrying in the background)."""
        return self.instance_id is not None

    def _publish(self) -> None:
        """Register, put every manifest, set the status; on a failure after registering, delete it again."""
        self.client.use_token(self._register_token)
        reg = self.client.register_instance(
            identity=self._identity,
            labels=self._labels,
            control_url=self._control_url,
            control_key=self._control_key,
            ranks=self._ranks,
            max_concurrent_pulls=self._max_pulls,
            compile_cache_keys=self._compile_cache_keys,
        )
        self.client.use_token(reg.token)
        try:
            for rank, manifest in self._manifests.items():
                self.client.put_manifest(reg.id, rank, manifest)
            self.client.set_status(reg.id, self._status)
        except Exception:
            with contextlib.suppress(Exception):
                self.client.delete_instance(reg.id)
            raise
        with self._lock:
            self.instance_id = str(reg.id)
            self.instance_token = reg.token
            self._identity_key = reg.identity_key
        log.info("published instance %s (%d rank(s)) as %s", reg.id, len(self._manifests), self._status)

    def _beat(self) -> None:
        interval = 2.0 if self.published else self._retry_interval_s
        while not self._stop.wait(interval):
            try:
                if self.instance_id is None:
                    self._publish()
                    interval = 2.0
                    continue
                beat = self.client.heartbeat(self.instance_id)
                interval = max(0.2, min((beat.ttl_s or 6.0) / 3.0, 10.0))
                if beat.reverify and not self._stop.is_set():
                    self._reverify()
                if beat.status == InstanceStatus.STALE and not self._stop.is_set():
                    self.client.set_status(self.instance_id, self._status)
                    log.warning("instance %s was STALE; set %s again", self.instance_id, self._status)
                if self._anchoring is not None and not self._stop.is_set():
                    self._anchoring.publish(self.client, self._identity_key)
            except (NotFound, AuthError) as exc:
                # 404, or 401 for our instance token: the planner no longer knows this instance (deleted,
                # or a new database); anything else (e.g. 403) is a real refusal, retried like an outage
                forgotten = self.instance_id is not None and (isinstance(exc, NotFound) or exc.status == 401)
                log.warning("%s: %s", "planner forgot us; registering again" if forgotten else "refused", exc)
                metrics.SEED_HEARTBEAT_FAILURES.inc()
                if forgotten:
                    with self._lock:
                        self.instance_id = None
                interval = 0.0 if forgotten else self._retry_interval_s
            except Exception as exc:  # noqa: BLE001 - keep beating; a planner restart must not kill the seed
                log.warning("heartbeat/publish for %s failed: %s", self.instance_id, exc)
                metrics.SEED_HEARTBEAT_FAILURES.inc()
                interval = self._retry_interval_s
                if self._on_error is not None:
                    self._on_error(exc)

    def _reverify(self) -> None:
        """A loader reported a checksum mismatch: re-hash the memory and republish every manifest. The
        planner compares them with the anchor: clean, the seed is offered again; else it stays refused
        (DigestMismatch, logged) until a clean republication."""
        if self._rehash is None or self.instance_id is None:
            log.warning("instance %s asked to re-verify, but it cannot re-hash its memory", self.instance_id)
            return
        log.warning("instance %s: a checksum mismatch was reported; re-hashing its memory", self.instance_id)
        self._manifests = dict(self._rehash())
        for rank, manifest in self._manifests.items():
            self.client.put_manifest(self.instance_id, rank, manifest)
        log.info("instance %s re-verified clean", self.instance_id)

    def close(self) -> None:
        """DRAINING, then delete the instance; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=5)
        if self.instance_id is not None:
            try:
                self.client.set_status(self.instance_id, "DRAINING")
                self.client.delete_instance(self.instance_id)
                log.info("instance %s drained and deleted", self.instance_id)
            except Exception as exc:  # noqa: BLE001 - best effort on the way out; the reaper ages it out
                log.warning("could not drain instance %s cleanly: %s", self.instance_id, exc)
        with contextlib.suppress(Exception):
            self.client.close()
