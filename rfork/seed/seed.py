"""Seeds: serve a rank's weights for one-sided reads and announce them to the planner.

A seed process holds one or more ranks (`RankWeights`). `RankWeights.from_tensors` serves tensors
where they already live: the regions are the merged address ranges covering them, nothing is
copied and the caller's module is never re-pointed (the checkpoint path `rfork seed --checkpoint`
keeps its own flat regions, read straight from disk). For each transport provider the seed opens
one engine and registers every region once with remote *read* access only, so the published
descriptors never allow writes. It then publishes identity + rank manifests (one planner instance
per provider), goes READY and heartbeats from a background thread. `close()` marks DRAINING,
deletes the instance and deregisters. The weights must not change while READY (readers would see
torn tensors and fail their digest check); nothing here writes to them."""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rfork.identity import SourceIdentity
from rfork.weights.rank_weights import RankWeights

log = logging.getLogger(__name__)


def open_engine(provider: str, *, domains: int = 1, timeout_s: float = 10.0) -> Any:
    from backends import TransferEngine

    return TransferEngine(provider, domains, timeout_s=timeout_s)


@dataclass(kw_only=True)
class ServedRank:
    weights: RankWeights
    regions: list[Any]

    def descriptors(self) -> list[bytes]:
        return [bytes(r.descriptor.to_bytes()) for r in self.regions]


class RankServer:
    """One provider's engine serving some ranks' regions (read-only). Thread-safe close."""

    def __init__(self, *, engine: Any, owns_engine: bool = True) -> None:
        self.engine = engine
        self.provider = str(getattr(engine, "provider", "tcp"))
        self._owns_engine = owns_engine
        self.ranks: dict[int, ServedRank] = {}

    def serve(self, weights: RankWeights, *, regions: Sequence[Any] | None = None) -> ServedRank:
        """Register weights' regions read-only (or adopt registrations made already, e.g. by the loader)."""
        if regions is None:
            t0 = time.perf_counter()
            targets = weights.registrables()
            if weights.device.type == "cuda" and not getattr(self.engine, "device_memory", False):
                targets = weights.host_mirrors()  # no FI_HMEM here: serve a host copy (not run on a GPU)
            regions = [self.engine.register(target, access="read") for target in targets]
            log.info(
                "registered %d region(s), %d bytes, for rank %d on %s in %.3f s",
                len(regions),
                sum(weights.layout.region_sizes),
                weights.rank,
                self.provider,
                time.perf_counter() - t0,
            )
        served = ServedRank(weights=weights, regions=list(regions))
        self.ranks[weights.rank] = served
        return served

    def address_bytes(self) -> bytes:
        addr = self.engine.address
        return bytes(addr.to_bytes() if hasattr(addr, "to_bytes") else addr)

    def close(self) -> None:
        for served in self.ranks.values():
            for reg in served.regions:
                with contextlib.suppress(Exception):
                    self.engine.deregister(reg)
        self.ranks.clear()
        if self._owns_engine:
            with contextlib.suppress(Exception):
                self.engine.close()


def start_control_server(
    weights_by_rank: Mapping[int, RankWeights],
    *,
    host: str,
    control_key: str,
    instance_ids: Callable[[], Sequence[str]],
) -> Any | None:
    """The NCCL-fallback control endpoint (rfork.seed.control, if installed); None when absent or failing.

    It binds `host` (the seed's routable address) and opens sessions only for loaders presenting a
    planner-issued token signed with `control_key` for one of `instance_ids()`.
    """
    if importlib.util.find_spec("rfork.seed.control") is None:
        return None
    try:
        from rfork.seed.control import ControlServer

        def tensors_for_rank(rank: int) -> Sequence[torch.Tensor]:
            return weights_by_rank[rank].ordered_nonempty()

        server = ControlServer(
            host=host,
            port=0,
            tensors_for_rank=tensors_for_rank,
            control_key=control_key,
            instance_ids=instance_ids,
        )
        server.start()
        return server
    except Exception:  # noqa: BLE001 - the fallback is optional; one-sided serving goes on without it
        log.warning("seed control endpoint did not start; serving without the NCCL fallback", exc_info=True)
        return None


def routable_host(planner_url: str) -> str:
    """$RFORK_CONTROL_HOST, else this host's address on the route towards the planner (never 0.0.0.0)."""
    configured = os.environ.get("RFORK_CONTROL_HOST")
    if configured:
        return configured
    from urllib.parse import urlsplit

    target = urlsplit(planner_url).hostname or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(target), 9))  # UDP: no packet is sent
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def default_labels() -> dict[str, str]:
    """Topology labels: $RFORK_NODE / $RFORK_RACK / $RFORK_ZONE when set (and non-empty), else the
    hostname / rack0 / zone0 (deploy/kubernetes/seed.yaml sets RFORK_NODE from the pod's node name)."""
    return {
        "node": os.environ.get("RFORK_NODE") or socket.gethostname(),
        "rack": os.environ.get("RFORK_RACK") or "rack0",
        "zone": os.environ.get("RFORK_ZONE") or "zone0",
    }


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
        ranks: Sequence[dict[str, Any]],
        manifests: Mapping[int, dict[str, Any]],
        labels: Mapping[str, str] | None = None,
        control_url: str | None = None,
        control_key: str | None = None,
        max_concurrent_pulls: int = 2,
        status: str = "READY",
        origin: Mapping[int, str] | None = None,
        retry: bool = False,
        retry_interval_s: float = 2.0,
        on_heartbeat_error: Callable[[Exception], None] | None = None,
    ) -> None:
        from planner.client import PlannerClient, PlannerUnavailable

        self.client = PlannerClient(planner_url, token=token)
        self._register_token = token
        self._identity = identity
        self._ranks = list(ranks)
        self._manifests = {
            r: {**m, "origin": (origin or {}).get(r, "disk")} for r, m in manifests.items()
        }
        self._labels = dict(labels or default_labels())
        self._control_url = control_url
        self._control_key = control_key
        self._max_pulls = max_concurrent_pulls
        self._status = status
        self._retry_interval_s = retry_interval_s
        self._lock = threading.Lock()
        self.instance_id: str | None = None
        self.instance_token: str | None = None  # acts as this instance only (set on registering)
        self._stop = threading.Event()
        self._on_error = on_heartbeat_error
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
            identity=self._identity.to_dict(),
            labels=self._labels,
            control_url=self._control_url,
            control_key=self._control_key,
            ranks=self._ranks,
            max_concurrent_pulls=self._max_pulls,
        )
        if getattr(reg, "token", None):
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
            self.instance_token = getattr(reg, "token", None)
        log.info("published instance %s (%d rank(s)) as %s", reg.id, len(self._manifests), self._status)

    def _beat(self) -> None:
        from planner.client import AuthError, NotFound

        interval = 2.0 if self.published else self._retry_interval_s
        while not self._stop.wait(interval):
            try:
                if self.instance_id is None:
                    self._publish()
                    interval = 2.0
                    continue
                resp = self.client.heartbeat(self.instance_id)
                ttl = float(resp.get("ttl_s") or 6.0)
                interval = max(0.2, min(ttl / 3.0, 10.0))
                if resp.get("status") == "STALE" and not self._stop.is_set():
                    self.client.set_status(self.instance_id, self._status)
                    log.warning("instance %s was STALE; set %s again", self.instance_id, self._status)
            except (NotFound, AuthError) as exc:
                # 404, or 401 for our instance token: the planner no longer knows this instance (deleted,
                # or a new database); anything else (e.g. 403) is a real refusal, retried like an outage
                forgotten = self.instance_id is not None and (isinstance(exc, NotFound) or exc.status == 401)
                log.warning("%s: %s", "planner forgot us; registering again" if forgotten else "refused", exc)
                if forgotten:
                    with self._lock:
                        self.instance_id = None
                interval = 0.0 if forgotten else self._retry_interval_s
            except Exception as exc:  # noqa: BLE001 - keep beating; a planner restart must not kill the seed
                log.warning("heartbeat/publish for %s failed: %s", self.instance_id, exc)
                interval = self._retry_interval_s
                if self._on_error is not None:
                    self._on_error(exc)

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


class Seed:
    """A process-local seed: weights for some ranks, one engine per provider, one planner instance each.

    Usage: `with Seed(weights=[...], identity=..., planner_url=...) as seed: ...` (or start()/close()).
    """

    def __init__(
        self,
        *,
        weights: Sequence[RankWeights],
        identity: SourceIdentity,
        planner_url: str,
        providers: Sequence[str] = ("tcp",),
        token: str | None = None,
        labels: Mapping[str, str] | None = None,
        domains: int = 1,
        timeout_s: float = 10.0,
        max_concurrent_pulls: int = 2,
        control: bool = True,
        control_host: str | None = None,
        servers: Sequence[RankServer] | None = None,
        retry_publish: bool = False,
    ) -> None:
        if not weights:
            raise ValueError("a seed needs at least one rank")
        ranks = [w.rank for w in weights]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"duplicate ranks {ranks}")
        self.weights = {w.rank: w for w in weights}
        self.identity = identity
        self.planner_url = planner_url
        self.providers = list(providers) if servers is None else [s.provider for s in servers]
        self.token = token
        self.labels = dict(labels) if labels else default_labels()
        self.domains = domains
        self.timeout_s = timeout_s
        self.max_concurrent_pulls = max_concurrent_pulls
        self.control = control
        self.control_host = control_host
        self.retry_publish = retry_publish
        self.servers: list[RankServer] = list(servers or [])
        self.publications: list[Publication] = []
        self.control_server: Any | None = None
        self._lock = threading.Lock()

    @property
    def instance_ids(self) -> list[str]:
        """The planner ids of the publications that are registered now."""
        return [p.instance_id for p in self.publications if p.instance_id is not None]

    def start(self) -> Seed:
        """Register (unless servers were handed in), checksum, publish, READY, heartbeat."""
        try:
            t0 = time.perf_counter()
            for w in self.weights.values():
                w.compute_checksums()
            log.info("checksummed %d rank(s) in %.3f s", len(self.weights), time.perf_counter() - t0)
            if not self.servers:
                for provider in self.providers:
                    server = RankServer(
                        engine=open_engine(provider, domains=self.domains, timeout_s=self.timeout_s)
                    )
                    self.servers.append(server)
                    for w in self.weights.values():
                        server.serve(w)
            from planner.control_token import new_control_key

            control_key = new_control_key()
            if self.control:
                self.control_server = start_control_server(
                    self.weights,
                    host=self.control_host or routable_host(self.planner_url),
                    control_key=control_key,
                    instance_ids=lambda: self.instance_ids,
                )
            control_url = getattr(self.control_server, "url", None)
            for server in self.servers:
                address = base64.b64encode(server.address_bytes()).decode("ascii")
                backends = [server.provider] + (["nccl"] if control_url else [])
                rank_rows = [
                    {"rank": r, "provider": server.provider, "address": address, "backends": backends}
                    for r in sorted(server.ranks)
                ]
                manifests = {
                    r: s.weights.manifest(s.descriptors()).to_dict() for r, s in server.ranks.items()
                }
                self.publications.append(
                    Publication(
                        planner_url=self.planner_url,
                        token=self.token,
                        identity=self.identity,
                        ranks=rank_rows,
                        manifests=manifests,
                        labels=self.labels,
                        control_url=control_url,
                        control_key=control_key if control_url else None,
                        max_concurrent_pulls=self.max_concurrent_pulls,
                        origin={r: s.weights.origin for r, s in server.ranks.items()},
                        retry=self.retry_publish,
                    )
                )
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """DRAINING + delete every publication, stop the control endpoint, deregister, close engines."""
        with self._lock:
            for pub in self.publications:
                pub.close()
            self.publications.clear()
            if self.control_server is not None:
                with contextlib.suppress(Exception):
                    self.control_server.close()
                self.control_server = None
            for server in self.servers:
                server.close()
            self.servers.clear()

    def __enter__(self) -> Seed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
