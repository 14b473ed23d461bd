"""The loader: a rank's weights from a seed (one-sided reads), else NCCL, else disk; verify; seed.

Weights land where the caller wants them: `pull_into(named_tensors)` / `load_into(module)` read
straight into tensors the caller allocated (checked against the manifest's names, dtypes and shapes
before any byte moves); `load()` allocates flat buffers per the seed's manifest first and is a thin
layer over the same pull. Pipeline for one rank from one candidate:
  1. the destination's covering address ranges (`cover`) are the local regions; a registration
     thread registers (and pre-faults) region i+1 while region i is on the wire. They are
     registered with remote *read* access only: the same registrations are served once READY, so
     becoming a seed costs no second registration and writes are never granted to anyone;
  2. reads of `chunk_bytes` each, up to `max_inflight` in flight, in address order; shared or tied
     destination bytes are read once;
  3. a verifier thread digests each region's bytes in order as soon as they are final (xxh3-128
     on the host: the chunk is hashed while it is still in cache) and compares each tensor;
  4. report to the planner. Any failure (transport error, peer timeout, checksum mismatch, deadline)
     reports failure, excludes that seed and asks again; then NCCL, then disk into the same tensors.
Nothing is published as a seed until every tensor of every rank verified. A disk load has nothing to
compare with: its result says `verified=False`.
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

from backends.layout import Layout, Placement, views
from rfork.errors import ChecksumMismatch, DestinationMismatch, LoadFailed, ManifestError, PullError
from rfork.identity import SourceIdentity
from rfork.pull.anchoring import check_anchor
from rfork.pull.busy_wait import BusyWait, ask_with_wait, fallback_seconds
from rfork.seed.seed import RankServer, Seed, default_labels, open_engine
from rfork.weights import checksum as ck
from rfork.weights.checkpoint import CheckpointInfo, load_rank_from_disk, read_rank_into
from rfork.weights.hostmem import prefault
from rfork.weights.manifest import RankManifest
from rfork.weights.rank_weights import RankWeights
from rfork.weights.regions import allocate

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
    """What a load produced: weights per rank (the caller's tensors, or buffers + views), how, and
    the seed it became. `verified` is true only when every tensor's digest was compared with a seed's."""

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
        """Point the module's parameters at the loaded views (no copy): `load_state_dict(assign=True)`.

        For `load()` results; `Loader.load_into(module)` pulls into the module's own tensors instead.
        """
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


def check_destination(dest: RankWeights, manifest: RankManifest) -> None:
    """Names, dtypes and shapes of the caller's tensors against the manifest, before any byte moves.

    Raises DestinationMismatch naming the first bad tensor (manifest order, then extra names).
    """
    have = {p.name: p for p in dest.layout.placements}
    for t in manifest.tensors:
        p = have.get(t.name)
        if p is None:
            raise DestinationMismatch(
                f"rank {dest.rank}: tensor {t.name!r} is in the manifest but has no destination"
            )
        if p.dtype != t.dtype or tuple(p.shape) != tuple(t.shape):
            raise DestinationMismatch(
                f"rank {dest.rank}: tensor {t.name!r} is {t.dtype}{list(t.shape)} at the seed, "
                f"the destination {p.dtype}{list(p.shape)}"
            )
    published = {t.name for t in manifest.tensors}
    for p in dest.layout.placements:
        if p.name not in published:
            raise DestinationMismatch(
                f"rank {dest.rank}: destination tensor {p.name!r} is not in the manifest"
            )


@dataclass(slots=True)
class _Span:
    """A distinct destination byte span (tied names share one) and its running digest."""

    offset: int
    end: int
    names: list[str]
    digest: ck.StreamingDigest | None
    done: bool = False


@dataclass(slots=True)
class _Read:
    """One read: destination region/offset, source region/offset, length."""

    region: int
    offset: int
    src_region: int
    src_offset: int
    nbytes: int
    done: bool = False


def plan_reads(dest: RankWeights, manifest: RankManifest, chunk_bytes: int) -> list[list[_Read]]:
    """Reads per destination region, in address order, at most `chunk_bytes` each; bytes that several
    destination tensors share (tied or overlapping) are read once."""
    src = {t.name: t for t in manifest.tensors}
    per_region: list[list[tuple[int, int, int, int]]] = [[] for _ in dest.layout.region_sizes]
    for p in dest.layout.placements:
        if p.nbytes:
            t = src[p.name]
            per_region[p.region].append((p.offset, -p.nbytes, t.region, t.offset))
    plan: list[list[_Read]] = []
    for region, spans in enumerate(per_region):
        reads: list[_Read] = []
        covered = 0
        for offset, neg, src_region, src_offset in sorted(spans):
            end = offset - neg
            if end <= covered:
                continue
            start = max(offset, covered)
            for lo in range(start, end, chunk_bytes):
                n = min(chunk_bytes, end - lo)
                reads.append(_Read(region, lo, src_region, src_offset + (lo - offset), n))
            covered = end
        plan.append(reads)
    return plan


class _Faulted:
    """How far each destination region is pre-faulted: the registration thread raises the marks, the
    submitting thread waits before posting a read above them. A read posted into pages not yet
    faulted in takes each 4 KiB fault inside the transport's kernel copy (socket receive or
    process_vm_readv), several times slower than faulting the same pages in ahead."""

    def __init__(self, regions: int) -> None:
        self._upto = [0] * regions
        self._cond = threading.Condition()

    def raise_to(self, region: int, upto: int) -> None:
        with self._cond:
            self._upto[region] = upto
            self._cond.notify_all()

    def finish(self) -> None:
        """No more pre-faulting (done, not wanted, device memory, or stopped): nothing waits any more."""
        with self._cond:
            self._upto = [1 << 62] * len(self._upto)
            self._cond.notify_all()

    def wait(self, region: int, upto: int, timeout_s: float) -> None:
        if self._upto[region] >= upto:
            return
        with self._cond:
            if not self._cond.wait_for(lambda: self._upto[region] >= upto, timeout=timeout_s):
                raise TimeoutError("deadline")


class _Puller:
    """One rank from one candidate over one-sided reads, into `dest` (see the module docstring)."""

    def __init__(
        self,
        *,
        engine: Any,
        manifest: RankManifest,
        dest: RankWeights,
        chunk_bytes: int,
        max_inflight: int,
        deadline: float,
        progress: ProgressFn | None,
        prefault: bool = True,
        staged: bool = False,
    ) -> None:
        self.engine = engine
        self.manifest = manifest
        self.dest = dest
        self.prefault = prefault
        self.rank = dest.rank
        self.chunk_bytes = chunk_bytes
        self.max_inflight = max_inflight
        self.deadline = deadline
        self.progress = progress
        self.phases: dict[str, float] = {}
        self._verify_s = 0.0
        self._expected = {t.name: t.checksum for t in manifest.tensors}
        # GPU destinations (no FI_HMEM on these providers) read through pinned host bounce slots.
        self.staged = staged or dest.device.type == "cuda"
        self._streaming = dest.checksum_algorithm == ck.XXH3_128 and not self.staged
        self._spans = self._span_table()

    def _span_table(self) -> list[list[_Span]]:
        by_key: dict[tuple[int, int, int], _Span] = {}
        table: list[list[_Span]] = [[] for _ in self.dest.layout.region_sizes]
        for p in self.dest.layout.placements:
            if not p.nbytes:
                continue
            key = (p.region, p.offset, p.nbytes)
            span = by_key.get(key)
            if span is None:
                digest = ck.StreamingDigest() if self._streaming else None
                span = by_key[key] = _Span(p.offset, p.offset + p.nbytes, [], digest)
                table[p.region].append(span)
            span.names.append(p.name)
        for spans in table:
            spans.sort(key=lambda sp: sp.offset)
        return table

    def _verify_upto(self, region: int, lo: int, hi: int) -> None:
        """Digest region bytes [lo, hi) (final now, fed in order) and check every span that ends by hi."""
        t = time.perf_counter()
        try:
            base = self.dest.ranges[region].ptr
            for span in self._spans[region]:
                if span.done or span.offset >= hi:
                    continue
                if span.digest is not None:
                    start = max(span.offset, lo, span.offset + span.digest.fed)
                    span.digest.update(base + start, min(span.end, hi) - start)
                if span.end <= hi:
                    self._check(span)
        finally:
            self._verify_s += time.perf_counter() - t

    def _check(self, span: _Span) -> None:
        span.done = True
        first = span.names[0]
        got = (
            span.digest.hexdigest()
            if span.digest is not None
            else ck.tensor_checksum(self.dest.tensors[first])
        )
        for name in span.names:
            if got != self._expected[name]:
                raise ChecksumMismatch(
                    f"tensor {name!r} of rank {self.rank}: checksum {got} != published {self._expected[name]}"
                )
            self.dest.checksums[name] = got

    def run(self) -> list[Any] | None:
        """Pull and verify every tensor; returns the local registrations (one per destination region),
        or None when the pull went through bounce slots."""
        from backends import MemoryRegionDescriptor

        dest = self.dest
        for p in dest.layout.placements:
            if not p.nbytes:
                verify_tensors(dest, self._expected, [p.name])
        remote = {r.index: MemoryRegionDescriptor.from_bytes(r.descriptor) for r in self.manifest.regions}
        if self.staged:
            self._run_staged(remote)
            return None  # nothing registered: a seed it becomes registers (or mirrors) afresh
        plan = plan_reads(dest, self.manifest, self.chunk_bytes)
        total = sum(r.nbytes for reads in plan for r in reads)
        done_bytes = 0
        reg_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rfork-register")
        verify_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rfork-verify")
        verify_futs: list[Future[None]] = []
        targets = dest.registrables()
        reg_futs: list[Future[Any]] = [Future() for _ in targets]
        stop_prefault = threading.Event()
        faulted = _Faulted(len(targets))
        reg_pool.submit(self._register_all, targets, reg_futs, stop_prefault, faulted)
        frontier = [0] * len(plan)  # per region: reads[:frontier] are all done
        final_at = [0] * len(plan)  # per region: bytes below this are final
        t_first = time.perf_counter()
        reg_wait = 0.0
        inflight: deque[tuple[Future[Any], _Read]] = deque()
        local_regions: list[Any] = []
        ok = False

        def retire() -> int:
            fut, rd = inflight.popleft()
            fut.result(timeout=self._left())
            rd.done = True
            reads, k = plan[rd.region], frontier[rd.region]
            while k < len(reads) and reads[k].done:
                k += 1
            if k != frontier[rd.region]:
                frontier[rd.region] = k
                lo, hi = final_at[rd.region], reads[k - 1].offset + reads[k - 1].nbytes
                if k == len(reads):
                    hi = dest.layout.region_sizes[rd.region]
                final_at[rd.region] = hi
                verify_futs.append(verify_pool.submit(self._verify_upto, rd.region, lo, hi))
            return rd.nbytes

        try:
            for region, reads in enumerate(plan):
                t_reg = time.perf_counter()
                local = reg_futs[region].result(timeout=self._left())
                reg_wait += time.perf_counter() - t_reg
                local_regions.append(local)
                if not reads:
                    size = dest.layout.region_sizes[region]
                    verify_futs.append(verify_pool.submit(self._verify_upto, region, 0, size))
                for rd in reads:
                    while len(inflight) >= self.max_inflight:
                        done_bytes += retire()
                        self._report(done_bytes, total)
                    faulted.wait(region, rd.offset + rd.nbytes, self._left())
                    fut = self.engine.read(local, rd.offset, rd.nbytes, remote[rd.src_region], rd.src_offset)
                    inflight.append((fut, rd))
            while inflight:
                done_bytes += retire()
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
                "rank %d: register wait %.3f s, transfer %.3f s (%.2f GB/s), "
                "verify %.3f s on the verifier thread, %.3f s of it after the last read",
                self.rank,
                reg_wait,
                self.phases["transfer"],
                total / max(t_last - t_first, 1e-9) / 1e9,
                self._verify_s,
                t_end - t_last,
            )
            ok = True
            return local_regions
        except TimeoutError as exc:
            raise PullError(f"rank {self.rank}: deadline passed") from exc
        finally:
            stop_prefault.set()
            faulted.finish()
            for fut, _ in inflight:
                fut.cancel()
            if not ok:
                # outstanding reads may still land in these buffers: wait them out before releasing
                for fut, _ in inflight:
                    with contextlib.suppress(Exception):
                        fut.exception(timeout=max(self._left(), 1.0))
                for f in reg_futs:
                    with contextlib.suppress(Exception):
                        reg = f.result(timeout=30)
                        self.engine.deregister(reg)
            reg_pool.shutdown(wait=not ok)
            verify_pool.shutdown(wait=True, cancel_futures=not ok)

    def _run_staged(self, remote: Mapping[int, Any]) -> None:
        """Each distinct destination tensor through a StagedReader (pinned bounce slots, then a device
        copy), verified on its device as it lands. Nothing of the destination is registered."""
        from backends.providers.staging import StagedReader

        src = {t.name: t for t in self.manifest.tensors}
        spans = [span for region in self._spans for span in region]
        total = sum(span.end - span.offset for span in spans)
        device = self.dest.device if self.dest.device.type == "cuda" else None
        reader = StagedReader(self.engine, device=device)
        t_first = time.perf_counter()
        futs: list[tuple[_Span, Future[int]]] = []
        try:
            for span in spans:
                entry = src[span.names[0]]
                tensor = self.dest.tensors[span.names[0]]
                futs.append(
                    (span, reader.read_into(tensor, 0, entry.nbytes, remote[entry.region], entry.offset))
                )
            done = 0
            for span, fut in futs:
                fut.result(timeout=self._left())
                done += span.end - span.offset
                self._report(done, total)
                t = time.perf_counter()
                self._check(span)
                self._verify_s += time.perf_counter() - t
        except TimeoutError as exc:
            raise PullError(f"rank {self.rank}: deadline passed") from exc
        finally:
            reader.close()  # waits out whatever is still queued: the bounce slots are quiet after
        self.phases.update(transfer=time.perf_counter() - t_first - self._verify_s, verify=self._verify_s)

    def _register_all(
        self,
        targets: Sequence[Any],
        futs: Sequence[Future[Any]],
        stop: threading.Event,
        faulted: _Faulted,
    ) -> None:
        """Register every destination region read-only (in order: reads of region i start as soon as it
        is), then pre-fault the host ones in order, a piece at a time, raising `faulted` as it goes:
        reads wait for it, so they copy into faulted pages, while the next pieces fault in."""
        try:
            for target, fut in zip(targets, futs, strict=True):
                try:
                    fut.set_result(self.engine.register(target, access="read"))
                except BaseException as exc:  # noqa: BLE001 - handed to the puller, which fails the attempt
                    fut.set_exception(exc)
                    for rest in futs:
                        if not rest.done():
                            rest.set_exception(
                                PullError(f"rank {self.rank}: an earlier region did not register")
                            )
                    return
            if not self.prefault:
                return
            piece = 16 << 20
            for region, target in enumerate(targets):
                span = _host_span(target)
                if span is None:
                    continue
                ptr, nbytes = span
                for off in range(0, nbytes, piece):
                    if stop.is_set():
                        return
                    prefault(ptr + off, min(piece, nbytes - off))
                    faulted.raise_to(region, off + piece)
                faulted.raise_to(region, 1 << 62)
        finally:
            faulted.finish()

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline")
        return left

    def _report(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(done, total)


_warmed: set[str] = set()


def warm_transport(providers: Sequence[str]) -> None:
    """Get the transport ready to open fast; call it as early as possible (a CLI at start-up).

    Imports the native library on the calling thread (its dlopen holds the GIL for about 0.2 s: here
    it stalls nothing that runs later) and asks libfabric for the first provider on a helper thread:
    the first fi_getinfo initialises every provider (about 0.1 s, GIL released), later ones are fast.
    """
    wanted = [p for p in providers if p != "nccl"][:1]
    if not wanted or wanted[0] in _warmed:
        return
    _warmed.add(wanted[0])
    from backends.providers.libfabric import provider_available

    threading.Thread(
        target=provider_available, args=(wanted[0],), name="rfork-transport-warm", daemon=True
    ).start()


def _host_span(target: Any) -> tuple[int, int] | None:
    """(ptr, nbytes) of a registration target in host memory; None for device memory."""
    if isinstance(target, tuple):
        return int(target[0]), int(target[1])
    if isinstance(target, torch.Tensor) and target.device.type == "cpu":
        return int(target.data_ptr()), target.numel() * target.element_size()
    return None


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
    # Fault destination pages in (MADV_POPULATE_WRITE) on the registration thread, ahead of the reads,
    # instead of inside the transport's receive copy.
    prefault: bool = True
    # Read through pinned host bounce slots (backends.providers.staging). Automatic for GPU destinations,
    # as tcp and shm cannot register device memory; setting it for host destinations exercises that path.
    staged_reads: bool = False
    # 429 all_busy (rfork.pull.busy_wait): wait for a seed unless the planner says the checkpoint, read at
    # `fallback_gbps` GB/s, would be sooner (None: never compare, just wait)
    busy_wait: BusyWait = field(default_factory=BusyWait)
    fallback_gbps: float | None = 2.0
    max_concurrent_pulls: int = 2  # the pull limit this instance publishes once it is a seed


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
            from rfork.weights.checkpoint import read_checkpoint_info

            checkpoint = read_checkpoint_info(checkpoint)
        self.checkpoint = checkpoint
        self.options = options or LoadOptions()
        self.progress = progress
        self._client: Any | None = None
        self._engine: Any | None = None
        self._engine_lock = threading.Lock()
        self._engine_future: Future[Any] | None = None
        self._last_phases: dict[str, float] = {}
        self._planner_s = 0.0

    # --- plumbing

    def _planner(self) -> Any | None:
        if self.planner_url is None:
            return None
        if self._client is None:
            t0 = time.perf_counter()
            from planner.client import PlannerClient

            self._client = PlannerClient(self.planner_url, token=self.token)
            self._planner_s += time.perf_counter() - t0
        return self._client

    def _get_engine(self) -> Any:
        with self._engine_lock:
            pending, self._engine_future = self._engine_future, None
        if pending is not None:
            try:
                engine = pending.result()
            except Exception:  # noqa: BLE001 - opened again below, where the error surfaces to the caller
                log.warning("opening the engine in the background failed; trying again", exc_info=True)
            else:
                with self._engine_lock:
                    if self._engine is None:
                        self._engine = engine
                        return engine
                engine.close()
        with self._engine_lock:
            if self._engine is None:
                self._engine = self._open_engine()
            return self._engine

    def _open_engine(self) -> Any:
        return open_engine(
            (self._one_sided() or ["tcp"])[0],
            domains=self.options.domains,
            timeout_s=self.options.transfer_timeout_s,
        )

    def _open_engine_soon(self) -> None:
        """Open the engine on a helper thread while the planner round trip and allocation run.

        The native transport library is imported here, on the calling thread: its dlopen holds the
        GIL for about 0.2 s, which on the helper thread would stall the planner round trip instead.
        """
        with self._engine_lock:
            if self._engine is not None or self._engine_future is not None:
                return
            fut: Future[Any] = Future()
            self._engine_future = fut
        warm_transport(self._one_sided())

        def opener() -> None:
            try:
                fut.set_result(self._open_engine())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(exc)

        threading.Thread(target=opener, name="rfork-engine-open", daemon=True).start()

    def prepare(self) -> None:
        """Start opening the engine (helper thread) and create the planner client now, so both overlap
        with whatever the caller does next (building the model); load/pull_into use them."""
        if self._one_sided() and self.planner_url is not None:
            self._open_engine_soon()
        self._planner()

    # --- the load

    def load(self, ranks: Sequence[int] | None = None) -> LoadResult:
        """Load every rank (default all of the identity's world) into buffers allocated per the seed's
        manifest, verify, and (by default) become a seed. Prefer `pull_into` when the tensors exist."""
        ranks = list(range(self.identity.world_size)) if ranks is None else list(ranks)
        return self._run(dict.fromkeys(ranks))

    def pull_into(self, named_tensors: Mapping[str, torch.Tensor], *, rank: int = 0) -> LoadResult:
        """Pull one rank straight into the caller's tensors (no copy, nothing allocated), verify, and
        (by default) serve them as a seed.

        The tensors must be contiguous, on one device, and match the manifest's names, dtypes and
        shapes (else DestinationMismatch naming the first bad tensor, before any byte moves). Tied or
        shared tensors are pulled once. On failure: the next candidate, then NCCL, then the disk
        checkpoint, all into the same tensors; the tensors' contents are undefined after an error.
        """
        return self._run({rank: RankWeights.from_tensors(rank=rank, tensors=named_tensors)})

    def load_into(self, module: torch.nn.Module, *, rank: int = 0) -> LoadResult:
        """`pull_into` the module's own parameters and persistent buffers (its state dict names)."""
        return self.pull_into(module.state_dict(keep_vars=True), rank=rank)

    def _run(self, dests: Mapping[int, RankWeights | None]) -> LoadResult:
        t0 = time.perf_counter()
        self._planner_s = 0.0
        if self._one_sided() and self.planner_url is not None:
            self._open_engine_soon()
        weights: dict[int, RankWeights] = {}
        regions: dict[int, list[Any] | None] = {}
        attempts: list[Attempt] = []
        sources: set[str] = set()
        try:
            for rank, dest in dests.items():
                w, regs, src = self._load_rank(rank, attempts, dest)
                weights[rank], regions[rank] = w, regs
                sources.add(src)
        except BaseException:
            self._close_engine()
            raise
        seconds = time.perf_counter() - t0
        total = sum(w.layout.total_bytes for w in weights.values())
        verified = "disk" not in sources
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
            verified=verified,
            attempts=attempts,
            phases=phases,
        )
        log.info("load phases (s): %s", ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
        log.info(
            "loaded %d rank(s), %d bytes, from %s in %.3f s (%.2f GB/s), %s",
            len(weights),
            total,
            source,
            seconds,
            total / max(seconds, 1e-9) / 1e9,
            "all checksums verified" if verified else "not verified (disk: nothing to compare with)",
        )
        if self.options.become_seed and self.planner_url is not None:
            self._become_seed(result, regions)
        else:
            self._close_engine()
        return result

    def _close_engine(self) -> None:
        with self._engine_lock:
            pending, self._engine_future = self._engine_future, None
        if pending is not None:
            with contextlib.suppress(Exception):
                pending.result().close()
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
            max_concurrent_pulls=self.options.max_concurrent_pulls,
            retry_publish=True,  # a planner outage must not throw the verified weights away
        )
        seed.start()
        self._engine = None  # the seed owns it now
        result.seed = seed
        log.info("now serving as seed %s", ",".join(seed.instance_ids))

    def _load_rank(
        self, rank: int, attempts: list[Attempt], dest: RankWeights | None
    ) -> tuple[RankWeights, list[Any] | None, str]:
        """One rank into `dest` (the caller's tensors), or into buffers allocated per the manifest."""
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
                weights, regs = self._pull(cand, rank, source, dest)
            except DestinationMismatch as exc:
                # The caller's tensors disagree with a manifest of the same identity: every source would.
                self._report(client, assignment, ok=False, nbytes=0, seconds=0.0, source=source, error=exc)
                raise
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
        return self._from_disk(rank, attempts, dest), None, "disk"

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

        def ask(waited_s: float) -> Any:
            return client.request_assignment(
                identity=self.identity.to_dict(),
                rank=rank,
                labels=dict(self.options.labels or default_labels()),
                providers=self._one_sided(),
                backends=list(backends),
                requester_id=None,
                exclude=list(excluded),
                fallback_s=self._fallback_s(),
                serves_after=self.options.max_concurrent_pulls if self.options.become_seed else 0,
                waited_s=waited_s,
            )

        try:
            a = ask_with_wait(ask, policy=self.options.busy_wait, busy_type=AllBusy, what=f"rank {rank}")
        except Exception as exc:  # noqa: BLE001 - a planner outage must still end in the disk fallback
            log.warning("rank %d: planner assignment failed: %s", rank, exc)
            return None
        if a is None:
            log.info("rank %d: no seed for identity %s (or waiting loses)", rank, self.identity.key()[:12])
        else:
            log.info(
                "rank %d: assigned %s (%d candidate(s))", rank, a.candidates[0].instance_id, len(a.candidates)
            )
        return a

    def _fallback_s(self) -> float | None:
        """Estimated seconds to load one rank from the checkpoint (None: no fallback to compare)."""
        if self.checkpoint is None:
            return None
        per_rank = self.checkpoint.total_bytes // max(self.identity.world_size, 1)
        return fallback_seconds(per_rank, self.options.fallback_gbps)

    def _one_sided(self) -> list[str]:
        """The one-sided providers asked for ("nccl" in `providers` means: the NCCL fallback only)."""
        return [p for p in self.options.providers if p != "nccl"]

    def _nccl_ok(self) -> bool:
        wanted = self.options.allow_nccl or "nccl" in self.options.providers
        return wanted and importlib.util.find_spec("rfork.pull.nccl") is not None

    def _source_name(self, cand: Any) -> str:
        if cand.provider in self._one_sided():
            return f"rfork-{cand.provider}"
        if "nccl" in (cand.backends or ()):
            return "nccl"
        return f"rfork-{cand.provider}"

    def _pull(
        self, cand: Any, rank: int, source: str, dest: RankWeights | None = None
    ) -> tuple[RankWeights, list[Any] | None]:
        try:
            manifest = RankManifest.from_dict(cand.manifest)
        except ManifestError as exc:
            raise PullError(f"seed {cand.instance_id}: bad manifest: {exc}") from exc
        if manifest.rank != rank:
            raise PullError(f"seed {cand.instance_id}: manifest is for rank {manifest.rank}, wanted {rank}")
        if dest is not None:
            check_destination(dest, manifest)
        deadline = time.monotonic() + self.options.rank_deadline_s
        self._last_phases = phases = {}
        if dest is None:
            t_alloc = time.perf_counter()
            layout = _layout_from_manifest(manifest)
            buffers = allocate(layout)
            dest = RankWeights(rank=rank, layout=layout, buffers=buffers, tensors=views(layout, buffers))
            phases["alloc"] = time.perf_counter() - t_alloc
        if manifest.checksum_algorithm != dest.checksum_algorithm:
            raise PullError(
                f"seed {cand.instance_id}: checksum algorithm {manifest.checksum_algorithm!r} "
                f"is not {dest.checksum_algorithm!r} (the digest for {dest.device} tensors)"
            )
        check_anchor(cand.instance_id, getattr(cand, "anchor", None), manifest)
        if source == "nccl":
            self._pull_nccl(cand, manifest, dest)
            return dest, None
        t_engine = time.perf_counter()
        engine = self._get_engine()
        phases["engine"] = time.perf_counter() - t_engine
        puller = _Puller(
            engine=engine,
            manifest=manifest,
            dest=dest,
            chunk_bytes=self.options.chunk_bytes,
            max_inflight=self.options.max_inflight,
            deadline=deadline,
            progress=self.progress,
            prefault=self.options.prefault,
            staged=self.options.staged_reads,
        )
        before = torch.get_num_threads()
        if self.options.pull_torch_threads:
            torch.set_num_threads(self.options.pull_torch_threads)
        try:
            regions = puller.run()
        finally:
            torch.set_num_threads(before)
            phases.update(puller.phases)
        return dest, regions

    def _pull_nccl(self, cand: Any, manifest: RankManifest, dest: RankWeights) -> None:
        from rfork.pull.nccl import pull_over_nccl  # type: ignore[import-not-found,unused-ignore]

        tensors = [dest.tensors[t.name] for t in manifest.tensors if t.nbytes]
        pull_over_nccl(
            cand.control_url,
            dest.rank,
            tensors,
            timeout_s=self.options.rank_deadline_s,
            control_token=getattr(cand, "control_token", None),
        )
        verify_tensors(dest, {t.name: t.checksum for t in manifest.tensors})

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

    def _from_disk(self, rank: int, attempts: list[Attempt], dest: RankWeights | None) -> RankWeights:
        """Read the rank from the checkpoint (into `dest` when given). Nothing to compare digests
        with, so the result is not verified; a seed it becomes computes its digests on start."""
        if self.checkpoint is None:
            last = next((a.error for a in reversed(attempts) if a.error), None)
            raise LoadFailed(
                f"rank {rank}: no seed could serve it and no checkpoint directory to fall back to "
                f"({len(attempts)} failed attempt(s){'; last: ' + last if last else ''})"
            )
        log.info("rank %d: loading from disk %s", rank, self.checkpoint.directory)
        t0 = time.perf_counter()
        if dest is None:
            layout, buffers, tensors = load_rank_from_disk(self.checkpoint, tp=self.identity.tp, rank=rank)
            weights = RankWeights(rank=rank, layout=layout, buffers=buffers, tensors=tensors)
        else:
            read_rank_into(self.checkpoint, dest.tensors, tp=self.identity.tp, rank=rank)
            weights = dest
            weights.checksums.clear()  # whatever a failed pull left there is not these bytes'
        seconds = time.perf_counter() - t0
        total = weights.layout.total_bytes
        log.info("rank %d from disk: read %.3f s (not verified: no digests to compare)", rank, seconds)
        if self.progress is not None:
            self.progress(total, total)
        attempts.append(
            Attempt(
                source="disk",
                instance_id=None,
                rank=rank,
                ok=True,
                bytes=total,
                seconds=seconds,
                phases={"read": seconds},
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


def pull_into(
    *,
    identity: SourceIdentity,
    planner_url: str | None,
    tensors: Mapping[str, torch.Tensor],
    rank: int = 0,
    checkpoint: CheckpointInfo | Path | str | None = None,
    token: str | None = None,
    options: LoadOptions | None = None,
    register_token: str | None = None,
) -> LoadResult:
    """One-call API for framework hooks: pull one rank into the framework's own tensors (see
    `Loader.pull_into`); returns how it went and the seed it became, if asked."""
    return Loader(
        identity=identity,
        planner_url=planner_url,
        token=token,
        register_token=register_token,
        checkpoint=checkpoint,
        options=options,
    ).pull_into(tensors, rank=rank)
