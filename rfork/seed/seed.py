"""Seeds: serve a rank's weights in place for one-sided reads and keep them published at the planner.

A seed process holds one or more ranks (`RankWeights`). For each transport provider it serves them on
one engine (`RankServer`), every region registered once with remote *read* access only, so published
descriptors never allow writes. What a seed serves is also what a pull hands over (`ServedRank`: the
weights, their registrations, the verified digests): a loader that becomes a seed gives it the engine
its reads used with the registrations they landed through (`Seed.adopt`), so a buffer is
registered once per process lifetime (per provider); registration is the expensive step on a real
NIC. Ranks a pull filled without registering (disk, NCCL, GPU bounce slots) are registered when the
seed starts. The seed also runs the NCCL fallback's control endpoint (`rfork.seed.control`), then
publishes identity + rank manifests (one planner instance per provider, `rfork.seed.publication`),
goes READY and heartbeats. `close()` drains: DRAINING, delete, deregister. The weights must not change while
READY (readers would see torn tensors and fail their digest check); nothing here writes to them.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from backends import TransferEngine
from planner.contract import PlannerClient, RankEndpoint, RankManifest, new_control_key
from rfork.compile_cache.anchor import CacheAnchoring
from rfork.compile_cache.shelf import CacheShelf
from rfork.identity import SourceIdentity, default_labels
from rfork.pull.result import LoadResult, ServedRank
from rfork.seed.control import ControlServer
from rfork.seed.publication import Publication, routable_host
from rfork.weights.rank_weights import RankWeights
from rfork.weights.stripes import publishes_stripes

log = logging.getLogger(__name__)


class RankServer:
    """One provider's engine serving some ranks' regions (read-only). Thread-safe close.

    `ranks`: registrations made on `engine` already (a pull's), adopted as they are.
    """

    def __init__(
        self, *, engine: TransferEngine, owns_engine: bool = True, ranks: Iterable[ServedRank] = ()
    ) -> None:
        self.engine = engine
        self.provider = str(getattr(engine, "provider", "tcp"))
        self._owns_engine = owns_engine
        self.ranks: dict[int, ServedRank] = {}
        for served in ranks:
            if served.registered_on(engine):
                self.ranks[served.weights.rank] = served

    def serve(self, weights: RankWeights) -> ServedRank:
        """Register the weights' regions read-only, unless this engine serves them already (adopted)."""
        held = self.ranks.pop(weights.rank, None)
        if held is not None:
            if held.weights is weights:
                self.ranks[weights.rank] = held
                return held
            self._deregister(held)  # other tensors of that rank are served from now on
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
        served = ServedRank(weights=weights, regions=regions)
        self.ranks[weights.rank] = served
        return served

    def address_bytes(self) -> bytes:
        """The engine's address, as the planner publishes it (base64 on the wire)."""
        return bytes(self.engine.address)

    def close(self) -> None:
        """Deregister every served region, then close the engine if this server owns it."""
        for served in self.ranks.values():
            self._deregister(served)
        self.ranks.clear()
        if self._owns_engine:
            with contextlib.suppress(Exception):
                self.engine.close()

    def _deregister(self, served: ServedRank) -> None:
        for reg in served.regions:
            with contextlib.suppress(Exception):
                self.engine.deregister(reg)


def start_control_server(
    weights_by_rank: Mapping[int, RankWeights],
    *,
    host: str,
    control_key: str,
    instance_ids: Callable[[], Sequence[str]],
    compile_caches: CacheShelf | None = None,
) -> ControlServer | None:
    """The NCCL fallback's control endpoint; None when it fails to start (one-sided serving goes on).

    It binds `host` (the seed's routable address) and opens sessions only for loaders presenting a
    planner-issued token signed with `control_key` for one of `instance_ids()`; it also serves
    `compile_caches` to compile-cache tokens.
    """
    try:

        def tensors_for_rank(rank: int) -> Sequence[torch.Tensor]:
            return weights_by_rank[rank].ordered_nonempty()

        server = ControlServer(
            host=host,
            port=0,
            tensors_for_rank=tensors_for_rank,
            control_key=control_key,
            instance_ids=instance_ids,
            compile_caches=compile_caches,
        )
        server.start()
        return server
    except Exception:  # noqa: BLE001 - the fallback is optional; one-sided serving goes on without it
        log.warning("seed control endpoint did not start; serving without the NCCL fallback", exc_info=True)
        return None


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
        providers: Sequence[str] | None = None,
        token: str | None = None,
        labels: Mapping[str, str] | None = None,
        domains: int = 1,
        timeout_s: float = 10.0,
        max_concurrent_pulls: int = 2,
        control: bool = True,
        control_host: str | None = None,
        servers: Sequence[RankServer] | None = None,
        retry_publish: bool = False,
        compile_caches: CacheShelf | None = None,
        client: PlannerClient | None = None,
    ) -> None:
        """`servers`: engines serving these weights already, adopted (a pull's, `Seed.adopt`):
        the seed registers on them only what is not registered yet, and closes them. `providers`: one
        engine each, opened here, for those no adopted server covers (default: tcp, when none is
        adopted). `client`: a planner client whose connections the publications share (a loader's).
        `compile_caches`: what the engine compiled, served on the control endpoint and published with
        the instance (rfork.compile_cache); needs `control`."""
        if not weights:
            raise ValueError("a seed needs at least one rank")
        ranks = [w.rank for w in weights]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"duplicate ranks {ranks}")
        self.weights = {w.rank: w for w in weights}
        self.identity = identity
        self.planner_url = planner_url
        self.servers: list[RankServer] = list(servers or [])
        adopted = [s.provider for s in self.servers]
        wanted = list(providers) if providers is not None else ([] if self.servers else ["tcp"])
        self.providers = adopted + [p for p in wanted if p not in adopted]
        self.token = token
        self.labels = dict(labels) if labels else default_labels()
        self.domains = domains
        self.timeout_s = timeout_s
        self.max_concurrent_pulls = max_concurrent_pulls
        self.control = control
        self.control_host = control_host
        self.retry_publish = retry_publish
        self.compile_caches = compile_caches
        self.client = client
        self.publications: list[Publication] = []
        self.control_server: ControlServer | None = None
        self._lock = threading.Lock()

    @classmethod
    def adopt(
        cls,
        result: LoadResult,
        *,
        planner_url: str,
        token: str | None,
        providers: Sequence[str] | None = None,
        labels: Mapping[str, str] | None = None,
        timeout_s: float = 10.0,
        max_concurrent_pulls: int = 2,
        retry_publish: bool = False,
        compile_caches: CacheShelf | None = None,
        weights: Sequence[RankWeights] | None = None,
    ) -> Seed:
        """Serve and publish a load's ranks (or `weights`, when what is served is not what was pulled),
        adopting the engine the load holds with its registrations: nothing registered before is
        registered again. `providers`: more engines to serve on (the held one covers the load's
        provider). The seed is `result.seed` from here on (`result.close()` drains it); on failure it
        is closed, the engine with it."""
        if result.seed is not None:
            raise RuntimeError("this load is a seed already")
        if weights is not None and sorted(w.rank for w in weights) != sorted(result.ranks):
            raise ValueError(
                f"serve the loaded ranks {sorted(result.ranks)}, not {[w.rank for w in weights]}"
            )
        engine, result.engine = result.engine, None
        servers = None
        if engine is not None:
            server = RankServer(engine=engine, ranks=result.ranks.values())
            for served in result.ranks.values():
                if served.weights.rank not in server.ranks:
                    served.regions = []  # on an engine a fence closed: gone with it
            servers = [server]
        seed = cls(
            weights=list(weights) if weights is not None else [s.weights for s in result.ranks.values()],
            identity=result.identity,
            planner_url=planner_url,
            token=token,
            providers=providers,
            labels=labels,
            timeout_s=timeout_s,
            max_concurrent_pulls=max_concurrent_pulls,
            servers=servers,
            retry_publish=retry_publish,
            compile_caches=compile_caches,
            client=result.client,
        )
        seed.start()  # closes itself (and the adopted engine) if it fails
        result.seed = seed
        return seed

    @property
    def instance_ids(self) -> list[str]:
        """The planner ids of the publications that are registered now."""
        return [p.instance_id for p in self.publications if p.instance_id is not None]

    def start(self) -> Seed:
        """Checksum, register what no adopted server holds yet, publish, READY, heartbeat."""
        try:
            t0 = time.perf_counter()
            striped = publishes_stripes(self.identity)
            for w in self.weights.values():
                w.compute_checksums()
                w.striped = w.striped or striped
                if w.striped:
                    w.compute_stripes()
            log.info("checksummed %d rank(s) in %.3f s", len(self.weights), time.perf_counter() - t0)
            for provider in self.providers[len(self.servers) :]:
                engine = TransferEngine(provider, self.domains, timeout_s=self.timeout_s)
                self.servers.append(RankServer(engine=engine))
            for server in self.servers:
                for w in self.weights.values():
                    server.serve(w)  # a no-op for what the server adopted registered
            control_key = new_control_key()
            if self.control:
                self.control_server = start_control_server(
                    self.weights,
                    host=self.control_host or routable_host(self.planner_url),
                    control_key=control_key,
                    instance_ids=lambda: self.instance_ids,
                    compile_caches=self.compile_caches,
                )
            control_url = self.control_server.url if self.control_server is not None else None
            shelf = self.compile_caches if control_url else None
            anchoring = CacheAnchoring(shelf) if shelf is not None else None
            for server in self.servers:
                address = base64.b64encode(server.address_bytes()).decode("ascii")
                backends = [server.provider] + (["nccl"] if control_url else [])
                rank_rows = [
                    RankEndpoint(rank=r, provider=server.provider, address=address, backends=backends)
                    for r in sorted(server.ranks)
                ]
                manifests = {r: s.weights.manifest(s.descriptors()) for r, s in server.ranks.items()}
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
                        compile_cache_keys=shelf.keys() if shelf is not None else (),
                        anchoring=anchoring,
                        max_concurrent_pulls=self.max_concurrent_pulls,
                        retry=self.retry_publish,
                        rehash=functools.partial(_rehash, server),
                        client=self.client,
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


def _rehash(server: RankServer) -> dict[int, RankManifest]:
    """Every rank's manifest with checksums computed afresh from the served memory (re-verification)."""
    out = {}
    for rank, served in server.ranks.items():
        served.weights.checksums.clear()
        served.weights.stripes.clear()
        served.weights.compute_checksums()
        out[rank] = served.weights.manifest(served.descriptors())
    return out
