"""The loader: a rank's weights from a seed (one-sided reads), else NCCL, else disk; verify; seed.

Pipeline for one rank from one candidate:
  1. parse the candidate's manifest, allocate one flat destination buffer per seed region;
  2. a registration thread registers region i+1 while region i is on the wire (regions are registered
     with remote *read* access from the start: the engine allows any registered region as the local
     destination of our own reads, and the same registrations are what we serve once READY, so
     becoming a seed costs no second registration and writes are never granted to anyone);
  3. reads of `chunk_bytes` each, up to `max_inflight` in flight across regions;
  4. as each region completes, a verifier thread checksums its tensors while later regions transfer;
  5. report to the planner. Any failure (transport error, peer timeout, checksum mismatch, deadline)
     reports failure, excludes that seed and asks again; after `max_attempts` or no source: disk.
Nothing is published as a seed until every tensor of every rank verified.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rfork import checksum as ck
from rfork.anchoring import check_anchor
from rfork.checkpoint import CheckpointInfo, load_rank_from_disk
from rfork.errors import ChecksumMismatch, LoadFailed, ManifestError, PullError
from rfork.identity import SourceIdentity
from rfork.layout import Layout, Placement, views
from rfork.manifest import RankManifest
from rfork.seed import RankServer, RankWeights, Seed, default_labels, open_engine

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]  # (bytes done so far, total bytes) for the current attempt


@dataclass(kw_only=True)
class Attempt:
    source: str  # "rfork-tcp", "nccl", "disk", ...
    instance_id: str | None
    rank: int
    ok: bool
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase (see LoadResult.phases)


@dataclass(kw_only=True)
class LoadResult:
    """What a load produced: weights per rank (region buffers + views), how, and the seed it became."""

    identity: SourceIdentity
    weights: dict[int, RankWeights]
    source: str
    bytes: int
    seconds: float
    verified: bool
    attempts: list[Attempt] = field(default_factory=list)
    seed: Seed | None = None
    server: RankServer | None = None
    # Seconds per phase, summed over ranks: planner (assignment + report round trips), alloc (destination
    # buffers), register (main thread blocked on registration), transfer (first read posted -> last read
    # done), verify (checksum work on the verifier thread, mostly overlapped with transfer), verify_tail
    # (waiting for the verifier after the last read), engine (opening the transfer engine), read (disk),
    # other (the rest of `seconds`: manifest parsing, views, ...).
    phases: dict[str, float] = field(default_factory=dict)

    def state_dict(self, rank: int = 0) -> dict[str, torch.Tensor]:
        return self.weights[rank].tensors

    def load_into(self, module: torch.nn.Module, rank: int = 0) -> None:
        """Point the module's parameters at the loaded views (no copy): `load_state_dict(assign=True)`."""
        module.load_state_dict(self.state_dict(rank), strict=True, assign=True)

    def close(self) -> None:
        if self.seed is not None:
            self.seed.close()
            self.seed = None
        if self.server is not None:
            self.server.close()
            self.server = None


def _layout_from_manifest(m: RankManifest) -> Layout:
    sizes = [0] * (max((r.index for r in m.regions), default=-1) + 1)
    for r in m.regions:
        sizes[r.index] = r.nbytes
    placements = tuple(
        Placement(
            name=t.name, dtype=t.dtype, shape=t.shape, nbytes=t.nbytes, region=t.region, offset=t.offset
        )
        for t in m.tensors
    )
    return Layout(region_sizes=tuple(sizes), placements=placements)


def verify_tensors(
    weights: RankWeights, expected: Mapping[str, str], names: Sequence[str] | None = None
) -> None:
    """Checksum `names` (default all) and compare; raises ChecksumMismatch naming the first bad tensor."""
    for name in names if names is not None else list(expected):
        got = ck.tensor_checksum(weights.tensors[name])
        if got != expected[name]:
            raise ChecksumMismatch(
                f"tensor {name!r} of rank {weights.rank}: checksum {got} != published {expected[name]}"
            )
        weights.checksums[name] = got


class _Puller:
    """One rank from one candidate over one-sided reads (see the module docstring for the pipeline)."""

    def __init__(
        self,
        *,
        engine: Any,
        manifest: RankManifest,
        rank: int,
        chunk_bytes: int,
        max_inflight: int,
        deadline: float,
        progress: ProgressFn | None,
    ) -> None:
        self.engine = engine
        self.manifest = manifest
        self.rank = rank
        self.chunk_bytes = chunk_bytes
        self.max_inflight = max_inflight
        self.deadline = deadline
        self.progress = progress
        self.phases: dict[str, float] = {}
        self._verify_s = 0.0

    def _verify(self, weights: RankWeights, expected: Mapping[str, str], names: Sequence[str]) -> None:
        t = time.perf_counter()
        try:
            verify_tensors(weights, expected, names)
        finally:
            self._verify_s += time.perf_counter() - t

    def run(self) -> tuple[RankWeights, list[Any]]:
        from backends import MemoryRegionDescriptor

        m = self.manifest
        layout = _layout_from_manifest(m)
        t_alloc = time.perf_counter()
        buffers = [torch.empty(n, dtype=torch.uint8) for n in layout.region_sizes]
        self.phases["alloc"] = time.perf_counter() - t_alloc
        weights = RankWeights(rank=self.rank, layout=layout, buffers=buffers, tensors=views(layout, buffers))
        expected = {t.name: t.checksum for t in m.tensors}
        by_region: dict[int, list[str]] = {}
        for t in m.tensors:
            if t.nbytes:
                by_region.setdefault(t.region, []).append(t.name)
            else:
                weights.checksums[t.name] = ck.tensor_checksum(weights.tensors[t.name])
                if weights.checksums[t.name] != t.checksum:
                    raise ChecksumMismatch(f"zero-byte tensor {t.name!r}: checksum {t.checksum} is not empty")
        remote = {r.index: MemoryRegionDescriptor.from_bytes(r.descriptor) for r in m.regions}
        total = sum(layout.region_sizes)
        done_bytes = 0
        local_regions: list[Any] = []
        reg_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rfork-register")
        verify_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rfork-verify")
        verify_futs: list[Future[None]] = []
        reg_futs = [reg_pool.submit(self.engine.register, buf, access="read") for buf in buffers]
        t_first = time.perf_counter()
        reg_wait = 0.0
        inflight: deque[tuple[Future[Any], int, int]] = deque()
        pending_per_region = [0] * len(buffers)
        ok = False
        try:
            for i, size in enumerate(layout.region_sizes):
                t_reg = time.perf_counter()
                local = reg_futs[i].result(timeout=self._left())
                reg_wait += time.perf_counter() - t_reg
                local_regions.append(local)
                for off in range(0, size, self.chunk_bytes):
                    n = min(self.chunk_bytes, size - off)
                    while len(inflight) >= self.max_inflight:
                        done_bytes += self._retire(
                            inflight,
                            pending_per_region,
                            weights,
                            expected,
                            by_region,
                            verify_pool,
                            verify_futs,
                        )
                        self._report(done_bytes, total)
                    fut = self.engine.read(local, off, n, remote[i], off)
                    inflight.append((fut, i, n))
                    pending_per_region[i] += 1
                if size == 0:
                    verify_futs.append(
                        verify_pool.submit(self._verify, weights, expected, by_region.get(i, []))
                    )
            while inflight:
                done_bytes += self._retire(
                    inflight, pending_per_region, weights, expected, by_region, verify_pool, verify_futs
                )
                self._report(done_bytes, total)
            t_last = time.perf_counter()
            for vf in verify_futs:
                vf.result(timeout=self._left())
            t_end = time.perf_counter()
            self.phases.update(
                register=reg_wait,
                transfer=t_last - t_first - reg_wait,
                verify=self._verify_s,
                verify_tail=t_end - t_last,
            )
            log.info(
                "rank %d: alloc %.3f s, register wait %.3f s, transfer %.3f s (%.2f GB/s), "
                "verify %.3f s on the verifier thread, %.3f s of it after the last read",
                self.rank,
                self.phases["alloc"],
                reg_wait,
                self.phases["transfer"],
                total / max(t_last - t_first, 1e-9) / 1e9,
                self._verify_s,
                t_end - t_last,
            )
            ok = True
            return weights, local_regions
        except TimeoutError as exc:
            raise PullError(f"rank {self.rank}: deadline passed") from exc
        finally:
            for fut, _, _ in inflight:
                fut.cancel()
            if not ok:
                # outstanding reads may still land in these buffers: wait them out before freeing
                for fut, _, _ in inflight:
                    with contextlib.suppress(Exception):
                        fut.exception(timeout=max(self._left(), 1.0))
                for f in reg_futs:
                    with contextlib.suppress(Exception):
                        reg = f.result(timeout=30)
                        self.engine.deregister(reg)
            reg_pool.shutdown(wait=not ok)
            verify_pool.shutdown(wait=True, cancel_futures=not ok)

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline")
        return left

    def _retire(
        self,
        inflight: deque[tuple[Future[Any], int, int]],
        pending: list[int],
        weights: RankWeights,
        expected: Mapping[str, str],
        by_region: Mapping[int, list[str]],
        pool: ThreadPoolExecutor,
        verify_futs: list[Future[None]],
    ) -> int:
        fut, region, n = inflight.popleft()
        fut.result(timeout=self._left())
        pending[region] -= 1
        if pending[region] == 0:
            verify_futs.append(pool.submit(self._verify, weights, expected, by_region.get(region, [])))
        return n

    def _report(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(done, total)


@dataclass(kw_only=True)
class LoadOptions:
    providers: Sequence[str] = ("tcp",)
    domains: int = 1
    chunk_bytes: int = 8 << 20
    max_inflight: int = 8
    transfer_timeout_s: float = 5.0  # the engine's dead-peer bound
    rank_deadline_s: float = 600.0
    max_attempts: int = 4
    exclude: Sequence[str] = ()
    labels: Mapping[str, str] | None = None
    become_seed: bool = True
    allow_nccl: bool = True
    # torch intra-op threads while a one-sided pull runs (restored after; None: leave as is). The
    # checksum gains little from a second thread but takes the core the transport's progress thread
    # (and, on one box, the seed's) needs; measured in docs/benchmarks.md.
    pull_torch_threads: int | None = 1


class Loader:
    """Load the ranks of one identity; see the module docstring. Not thread-safe; one load at a time."""

    def __init__(
        self,
        *,
        identity: SourceIdentity,
        planner_url: str | None,
        token: str | None = None,
        checkpoint: CheckpointInfo | Path | str | None = None,
        options: LoadOptions | None = None,
        progress: ProgressFn | None = None,
        register_token: str | None = None,
    ) -> None:
        self.identity = identity
        self.planner_url = planner_url
        self.token = token  # load role: request assignments, report
        self.register_token = register_token or token  # register role: become a seed
        if checkpoint is not None and not isinstance(checkpoint, CheckpointInfo):
            from rfork.checkpoint import read_checkpoint_info

            checkpoint = read_checkpoint_info(checkpoint)
        self.checkpoint = checkpoint
        self.options = options or LoadOptions()
        self.progress = progress
        self._client: Any | None = None
        self._engine: Any | None = None
        self._engine_lock = threading.Lock()
        self._last_phases: dict[str, float] = {}
        self._planner_s = 0.0

    # --- plumbing

    def _planner(self) -> Any | None:
        if self.planner_url is None:
            return None
        if self._client is None:
            from planner.client import PlannerClient

            self._client = PlannerClient(self.planner_url, token=self.token)
        return self._client

    def _get_engine(self) -> Any:
        with self._engine_lock:
            if self._engine is None:
                self._engine = open_engine(
                    (self._one_sided() or ["tcp"])[0],
                    domains=self.options.domains,
                    timeout_s=self.options.transfer_timeout_s,
                )
            return self._engine

    def prepare(self) -> None:
        """Open the engine and the planner client early (overlaps with building the model)."""
        self._get_engine()
        self._planner()

    # --- the load

    def load(self, ranks: Sequence[int] | None = None) -> LoadResult:
        """Load every rank (default all of the identity's world), verify, and (by default) become a seed."""
        t0 = time.perf_counter()
        ranks = list(range(self.identity.world_size)) if ranks is None else list(ranks)
        self._planner_s = 0.0
        weights: dict[int, RankWeights] = {}
        regions: dict[int, list[Any] | None] = {}
        attempts: list[Attempt] = []
        sources: set[str] = set()
        try:
            for rank in ranks:
                w, regs, src = self._load_rank(rank, attempts)
                weights[rank], regions[rank] = w, regs
                sources.add(src)
        except BaseException:
            self._close_engine()
            raise
        seconds = time.perf_counter() - t0
        total = sum(w.layout.total_bytes for w in weights.values())
        source = sources.pop() if len(sources) == 1 else "mixed"
        phases: dict[str, float] = {"planner": self._planner_s}
        for a in attempts:
            for k, v in a.phases.items():
                phases[k] = phases.get(k, 0.0) + v
        overlapped = {"verify"} if "transfer" in phases else set()  # pulls verify during the transfer
        phases["other"] = max(0.0, seconds - sum(v for k, v in phases.items() if k not in overlapped))
        phases = {k: round(v, 4) for k, v in phases.items()}
        result = LoadResult(
            identity=self.identity,
            weights=weights,
            source=source,
            bytes=total,
            seconds=seconds,
            verified=True,
            attempts=attempts,
            phases=phases,
        )
        log.info("load phases (s): %s", ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
        log.info(
            "loaded %d rank(s), %d bytes, from %s in %.3f s (%.2f GB/s), all checksums verified",
            len(ranks),
            total,
            source,
            seconds,
            total / max(seconds, 1e-9) / 1e9,
        )
        if self.options.become_seed and self.planner_url is not None:
            self._become_seed(result, regions)
        else:
            self._close_engine()
        return result

    def _close_engine(self) -> None:
        if self._engine is not None:
            with contextlib.suppress(Exception):
                self._engine.close()
            self._engine = None

    def _become_seed(self, result: LoadResult, regions: Mapping[int, list[Any] | None]) -> None:
        engine = self._get_engine()
        server = RankServer(engine=engine)
        for rank, w in result.weights.items():
            server.serve(w, regions=regions.get(rank))  # None (disk/nccl): register now, read-only
        assert self.planner_url is not None
        seed = Seed(
            weights=list(result.weights.values()),
            identity=self.identity,
            planner_url=self.planner_url,
            token=self.register_token,
            labels=self.options.labels,
            servers=[server],
            retry_publish=True,  # a planner outage must not throw the verified weights away
        )
        seed.start()
        self._engine = None  # the seed owns it now
        result.seed = seed
        log.info("now serving as seed %s", ",".join(seed.instance_ids))

    def _load_rank(self, rank: int, attempts: list[Attempt]) -> tuple[RankWeights, list[Any] | None, str]:
        client = self._planner()
        excluded = list(self.options.exclude)
        self._last_phases = {}
        for _ in range(self.options.max_attempts if client is not None else 0):
            # one-sided sources first; NCCL only when no one-sided provider is shared
            assignment = self._ask(client, rank, excluded, self._one_sided()) if self._one_sided() else None
            if assignment is None and self._nccl_ok():
                assignment = self._ask(client, rank, excluded, [*self._one_sided(), "nccl"])
            if assignment is None:
                break
            cand = assignment.candidates[0]
            source, started = self._source_name(cand), time.perf_counter()
            try:
                weights, regs = self._pull(cand, rank, source)
            except Exception as exc:  # noqa: BLE001 - any failure moves on to the next candidate
                seconds = time.perf_counter() - started
                log.warning(
                    "rank %d from %s (%s) failed after %.3f s: %s",
                    rank,
                    cand.instance_id,
                    source,
                    seconds,
                    exc,
                )
                attempts.append(
                    Attempt(
                        source=source,
                        instance_id=cand.instance_id,
                        rank=rank,
                        ok=False,
                        seconds=seconds,
                        error=str(exc),
                        phases=dict(self._last_phases),
                    )
                )
                self._report(
                    client, assignment, ok=False, nbytes=0, seconds=seconds, source=source, error=exc
                )
                excluded.append(cand.instance_id)
                continue
            seconds = time.perf_counter() - started
            nbytes = weights.layout.total_bytes
            attempts.append(
                Attempt(
                    source=source,
                    instance_id=cand.instance_id,
                    rank=rank,
                    ok=True,
                    bytes=nbytes,
                    seconds=seconds,
                    phases=dict(self._last_phases),
                )
            )
            self._report(
                client, assignment, ok=True, nbytes=nbytes, seconds=seconds, source=source, error=None
            )
            log.info(
                "rank %d: %d bytes from %s via %s in %.3f s, verified",
                rank,
                nbytes,
                cand.instance_id,
                source,
                seconds,
            )
            weights.origin = "peer"
            return weights, regs, source
        return self._from_disk(rank, attempts), None, "disk"

    def _ask(self, client: Any, rank: int, excluded: Sequence[str], backends: Sequence[str]) -> Any | None:
        t0 = time.perf_counter()
        try:
            return self._ask_once(client, rank, excluded, backends)
        finally:
            self._planner_s += time.perf_counter() - t0

    def _ask_once(
        self, client: Any, rank: int, excluded: Sequence[str], backends: Sequence[str]
    ) -> Any | None:
        from planner.client import AllBusy

        deadline = time.monotonic() + 30.0
        while True:
            try:
                a = client.request_assignment(
                    identity=self.identity.to_dict(),
                    rank=rank,
                    labels=dict(self.options.labels or default_labels()),
                    providers=self._one_sided(),
                    backends=list(backends),
                    requester_id=None,
                    exclude=list(excluded),
                )
            except AllBusy as busy:
                wait = float(getattr(busy, "retry_after_s", 1.0) or 1.0)
                if time.monotonic() + wait > deadline:
                    log.warning("rank %d: every seed busy for 30 s; giving up on R-Fork", rank)
                    return None
                log.info("rank %d: all seeds busy, retrying in %.1f s", rank, wait)
                time.sleep(min(wait, 5.0))
                continue
            except Exception as exc:  # noqa: BLE001 - a planner outage must still end in the disk fallback
                log.warning("rank %d: planner assignment failed: %s", rank, exc)
                return None
            if a is None:
                log.info("rank %d: planner has no source for identity %s", rank, self.identity.key()[:12])
            else:
                log.info(
                    "rank %d: assigned %s (%d candidate(s))",
                    rank,
                    a.candidates[0].instance_id,
                    len(a.candidates),
                )
            return a

    def _one_sided(self) -> list[str]:
        """The one-sided providers asked for ("nccl" in `providers` means: the NCCL fallback only)."""
        return [p for p in self.options.providers if p != "nccl"]

    def _nccl_ok(self) -> bool:
        wanted = self.options.allow_nccl or "nccl" in self.options.providers
        return wanted and importlib.util.find_spec("rfork.nccl_pull") is not None

    def _source_name(self, cand: Any) -> str:
        if cand.provider in self._one_sided():
            return f"rfork-{cand.provider}"
        if "nccl" in (cand.backends or ()):
            return "nccl"
        return f"rfork-{cand.provider}"

    def _pull(self, cand: Any, rank: int, source: str) -> tuple[RankWeights, list[Any] | None]:
        try:
            manifest = RankManifest.from_dict(cand.manifest)
        except ManifestError as exc:
            raise PullError(f"seed {cand.instance_id}: bad manifest: {exc}") from exc
        if manifest.rank != rank:
            raise PullError(f"seed {cand.instance_id}: manifest is for rank {manifest.rank}, wanted {rank}")
        if manifest.checksum_algorithm != ck.ALGORITHM:
            raise PullError(
                f"seed {cand.instance_id}: checksum algorithm {manifest.checksum_algorithm!r} "
                f"is not {ck.ALGORITHM!r}"
            )
        check_anchor(cand.instance_id, getattr(cand, "anchor", None), manifest)
        deadline = time.monotonic() + self.options.rank_deadline_s
        if source == "nccl":
            return self._pull_nccl(cand, rank, manifest), None
        t_engine = time.perf_counter()
        engine = self._get_engine()
        engine_s = time.perf_counter() - t_engine
        puller = _Puller(
            engine=engine,
            manifest=manifest,
            rank=rank,
            chunk_bytes=self.options.chunk_bytes,
            max_inflight=self.options.max_inflight,
            deadline=deadline,
            progress=self.progress,
        )
        self._last_phases = puller.phases
        puller.phases["engine"] = engine_s
        before = torch.get_num_threads()
        if self.options.pull_torch_threads:
            torch.set_num_threads(self.options.pull_torch_threads)
        try:
            return puller.run()
        finally:
            torch.set_num_threads(before)

    def _pull_nccl(self, cand: Any, rank: int, manifest: RankManifest) -> RankWeights:
        from rfork.nccl_pull import pull_over_nccl  # type: ignore[import-not-found,unused-ignore]

        layout = _layout_from_manifest(manifest)
        buffers = [torch.empty(n, dtype=torch.uint8) for n in layout.region_sizes]
        weights = RankWeights(rank=rank, layout=layout, buffers=buffers, tensors=views(layout, buffers))
        dest = [weights.tensors[t.name] for t in manifest.tensors if t.nbytes]
        pull_over_nccl(
            cand.control_url,
            rank,
            dest,
            timeout_s=self.options.rank_deadline_s,
            control_token=getattr(cand, "control_token", None),
        )
        verify_tensors(weights, {t.name: t.checksum for t in manifest.tensors})
        return weights

    def _report(
        self,
        client: Any,
        assignment: Any,
        *,
        ok: bool,
        nbytes: int,
        seconds: float,
        source: str,
        error: BaseException | None,
    ) -> None:
        reason = (
            None
            if ok
            else ("checksum_mismatch" if isinstance(error, ChecksumMismatch) else type(error).__name__)
        )
        t0 = time.perf_counter()
        try:
            client.report_transfer(
                assignment.id,
                outcome="success" if ok else "failure",
                bytes=nbytes,
                seconds=seconds,
                backend=source.removeprefix("rfork-"),
                reason=reason,
                error=None if error is None else str(error)[:2000],
            )
        except Exception as exc:  # noqa: BLE001 - the data is here; a lost report must not fail the load
            log.warning("could not report transfer %s: %s", assignment.id, exc)
        finally:
            self._planner_s += time.perf_counter() - t0

    def _from_disk(self, rank: int, attempts: list[Attempt]) -> RankWeights:
        if self.checkpoint is None:
            raise LoadFailed(
                f"rank {rank}: no seed could serve it and no checkpoint directory to fall back to "
                f"({len(attempts)} failed attempt(s))"
            )
        log.info("rank %d: loading from disk %s", rank, self.checkpoint.directory)
        t0 = time.perf_counter()
        layout, buffers, tensors = load_rank_from_disk(self.checkpoint, tp=self.identity.tp, rank=rank)
        t_read = time.perf_counter()
        weights = RankWeights(rank=rank, layout=layout, buffers=buffers, tensors=tensors)
        weights.compute_checksums()
        seconds = time.perf_counter() - t0
        phases = {"read": t_read - t0, "verify": seconds - (t_read - t0)}
        log.info("rank %d from disk: read %.3f s, verify %.3f s", rank, phases["read"], phases["verify"])
        if self.progress is not None:
            self.progress(layout.total_bytes, layout.total_bytes)
        attempts.append(
            Attempt(
                source="disk",
                instance_id=None,
                rank=rank,
                ok=True,
                bytes=layout.total_bytes,
                seconds=seconds,
                phases=phases,
            )
        )
        return weights


def load(
    *,
    identity: SourceIdentity,
    planner_url: str | None,
    ranks: Sequence[int] | None = None,
    checkpoint: CheckpointInfo | Path | str | None = None,
    token: str | None = None,
    options: LoadOptions | None = None,
    progress: ProgressFn | None = None,
    register_token: str | None = None,
) -> LoadResult:
    """One-call API for framework hooks: returns the weights (and the seed it became, if asked)."""
    return Loader(
        identity=identity,
        planner_url=planner_url,
        token=token,
        register_token=register_token,
        checkpoint=checkpoint,
        options=options,
        progress=progress,
    ).load(ranks)
