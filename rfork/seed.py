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
from dataclasses import dataclass, field
from typing import Any

import torch

from rfork import checksum as ck
from rfork.identity import SourceIdentity
from rfork.layout import DEFAULT_MAX_REGION_BYTES, AddressRange, Layout, buffer_ranges, cover, pack
from rfork.manifest import RankManifest, RegionEntry, TensorEntry

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class RankWeights:
    """One global rank's weights and the address ranges (regions) that cover them.

    Two shapes, one interface: `from_tensors` serves tensors where they already live (no copy; the
    regions are the merged ranges covering them), while the checkpoint path owns flat region
    `buffers` with the tensors as views into them. `checksums` fills in lazily (compute_checksums).
    """

    rank: int
    layout: Layout
    tensors: dict[str, torch.Tensor]
    buffers: list[torch.Tensor] = field(default_factory=list)  # owned flat regions; [] when in place
    ranges: list[AddressRange] = field(default_factory=list)  # region i's memory; from buffers if empty
    checksums: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.ranges:
            self.ranges = buffer_ranges(self.buffers)
        if len(self.ranges) != len(self.layout.region_sizes):
            raise ValueError(
                f"rank {self.rank}: {len(self.ranges)} address ranges "
                f"for {len(self.layout.region_sizes)} regions"
            )

    @classmethod
    def from_tensors(cls, *, rank: int = 0, tensors: Mapping[str, torch.Tensor]) -> RankWeights:
        """Serve `tensors` in place (a module's parameters and buffers, or a state dict): no copy.

        The regions are the merged address ranges covering the tensors (tied or shared storage
        once); the caller's tensors are kept as they are and must not change while served.
        """
        detached = {name: t.detach() for name, t in tensors.items()}
        layout, ranges = cover(detached)
        return cls(rank=rank, layout=layout, tensors=detached, ranges=ranges)

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, torch.Tensor],
        *,
        rank: int = 0,
        max_region_bytes: int = DEFAULT_MAX_REGION_BYTES,
    ) -> RankWeights:
        """Copy a state dict into fresh flat regions (prefer `from_tensors`, which copies nothing)."""
        layout, buffers, views = pack(
            {k: v.detach() for k, v in state_dict.items()}, max_region_bytes=max_region_bytes
        )
        return cls(rank=rank, layout=layout, buffers=buffers, tensors=views)

    @property
    def device(self) -> torch.device:
        """Where the weights live (one rank, one device); cpu when there are none."""
        return torch.device(self.ranges[0].device) if self.ranges else torch.device("cpu")

    @property
    def checksum_algorithm(self) -> str:
        return ck.algorithm_for(self.device)

    def registrables(self) -> list[Any]:
        """What to hand `engine.register` per region: the flat buffer, else the covering range."""
        if self.buffers:
            return list(self.buffers)
        return [_range_target(r, self.tensors) for r in self.ranges]

    def host_mirrors(self) -> list[torch.Tensor]:
        """A host copy of each region (page-locked where CUDA exists): what a seed registers for GPU
        weights when its provider cannot register device memory. Costs host memory equal to the weights."""
        pinned = torch.cuda.is_available()
        mirrors = [torch.empty(r.nbytes, dtype=torch.uint8, pin_memory=pinned) for r in self.ranges]
        for p in self.layout.placements:
            if p.nbytes:
                flat = self.tensors[p.name].reshape(-1).view(torch.uint8)
                mirrors[p.region][p.offset : p.offset + p.nbytes].copy_(flat)
        return mirrors

    def compute_checksums(self) -> dict[str, str]:
        for p in self.layout.placements:
            if p.name not in self.checksums:
                self.checksums[p.name] = ck.tensor_checksum(self.tensors[p.name])
        return self.checksums

    def ordered_nonempty(self) -> list[torch.Tensor]:
        """Tensors in manifest order, zero-byte ones skipped (what the NCCL fallback streams)."""
        return [self.tensors[p.name] for p in self.layout.placements if p.nbytes]

    def manifest(self, descriptors: Sequence[bytes]) -> RankManifest:
        sums = self.compute_checksums()
        regions = tuple(
            RegionEntry(index=i, nbytes=n, descriptor=descriptors[i])
            for i, n in enumerate(self.layout.region_sizes)
        )
        tensors = tuple(
            TensorEntry(
                name=p.name,
                dtype=p.dtype,
                shape=p.shape,
                nbytes=p.nbytes,
                region=p.region,
                offset=p.offset,
                checksum=sums[p.name],
            )
            for p in self.layout.placements
        )
        return RankManifest(
            rank=self.rank, checksum_algorithm=self.checksum_algorithm, regions=regions, tensors=tensors
        )


def _range_target(r: AddressRange, tensors: Mapping[str, torch.Tensor]) -> Any:
    """engine.register's argument for a covering range: (ptr, nbytes) on the host; on a GPU the one
    tensor spanning it exactly when there is one (CUDA registration needs a tensor), else the range."""
    if r.device == "cpu":
        return (r.ptr, r.nbytes)
    for t in tensors.values():
        if t.numel() and int(t.data_ptr()) == r.ptr and t.numel() * t.element_size() == r.nbytes:
            return t
    return (r.ptr, r.nbytes)


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


def start_control_server(weights_by_rank: Mapping[int, RankWeights]) -> Any | None:
    """The NCCL-fallback control endpoint (rfork.control, if installed); None when absent or failing."""
    if importlib.util.find_spec("rfork.control") is None:
        return None
    try:
        from rfork.control import ControlServer

        def tensors_for_rank(rank: int) -> Sequence[torch.Tensor]:
            return weights_by_rank[rank].ordered_nonempty()

        server = ControlServer(host="127.0.0.1", port=0, tensors_for_rank=tensors_for_rank)
        server.start()
        return server
    except Exception:  # noqa: BLE001 - the fallback is optional; one-sided serving goes on without it
        log.warning("seed control endpoint did not start; serving without the NCCL fallback", exc_info=True)
        return None


def default_labels() -> dict[str, str]:
    """Topology labels: $RFORK_NODE / $RFORK_RACK / $RFORK_ZONE when set (and non-empty), else the
    hostname / rack0 / zone0 (deploy/kubernetes/seed.yaml sets RFORK_NODE from the pod's node name)."""
    return {
        "node": os.environ.get("RFORK_NODE") or socket.gethostname(),
        "rack": os.environ.get("RFORK_RACK") or "rack0",
        "zone": os.environ.get("RFORK_ZONE") or "zone0",
    }


class Publication:
    """One planner instance: register, manifests, READY, heartbeat thread, DRAINING + delete on close."""

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
        max_concurrent_pulls: int = 2,
        status: str = "READY",
        on_heartbeat_error: Callable[[Exception], None] | None = None,
    ) -> None:
        from planner.client import PlannerClient

        self.client = PlannerClient(planner_url, token=token)
        reg = self.client.register_instance(
            identity=identity.to_dict(),
            labels=dict(labels or default_labels()),
            control_url=control_url,
            ranks=list(ranks),
            max_concurrent_pulls=max_concurrent_pulls,
        )
        self.instance_id: str = str(reg.id)
        self.instance_token: str | None = getattr(reg, "token", None)  # acts as this instance only
        if getattr(reg, "token", None):
            self.client.use_token(reg.token)
        self._stop = threading.Event()
        self._on_error = on_heartbeat_error
        self._closed = False
        try:
            for rank, manifest in manifests.items():
                self.client.put_manifest(self.instance_id, rank, manifest)
            self.client.set_status(self.instance_id, status)
        except Exception:
            with contextlib.suppress(Exception):
                self.client.delete_instance(self.instance_id)
            raise
        log.info("published instance %s (%d rank(s)) as %s", self.instance_id, len(manifests), status)
        self._thread = threading.Thread(
            target=self._beat, name=f"heartbeat-{self.instance_id[:8]}", daemon=True
        )
        self._thread.start()

    def _beat(self) -> None:
        interval = 2.0
        while not self._stop.wait(interval):
            try:
                resp = self.client.heartbeat(self.instance_id)
                ttl = float(resp.get("ttl_s") or 6.0)
                interval = max(0.2, min(ttl / 3.0, 10.0))
            except Exception as exc:  # noqa: BLE001 - keep beating; a planner restart must not kill the seed
                log.warning("heartbeat for %s failed: %s", self.instance_id, exc)
                if self._on_error is not None:
                    self._on_error(exc)

    def close(self) -> None:
        """DRAINING, then delete the instance; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.client.set_status(self.instance_id, "DRAINING")
            self.client.delete_instance(self.instance_id)
            log.info("instance %s drained and deleted", self.instance_id)
        except Exception as exc:  # noqa: BLE001 - best effort on the way out; the reaper ages it out otherwise
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
        servers: Sequence[RankServer] | None = None,
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
        self.servers: list[RankServer] = list(servers or [])
        self.publications: list[Publication] = []
        self.control_server: Any | None = None
        self._lock = threading.Lock()

    @property
    def instance_ids(self) -> list[str]:
        return [p.instance_id for p in self.publications]

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
            if self.control:
                self.control_server = start_control_server(self.weights)
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
                        max_concurrent_pulls=self.max_concurrent_pulls,
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
