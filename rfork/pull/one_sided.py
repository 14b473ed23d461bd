"""Pulling a rank over one-sided reads: the engine it reads with, and the read-and-verify pipeline.

For one rank from one seed, per its `ReadPlan` (rfork.pull.read_plan), into host memory (the caller's
tensors, or buffers allocated per the manifest):
  1. the destination's regions (`RankWeights.registrables`) are registered on a helper thread, region
     i+1 while region i is on the wire, read-only: the same registrations are served once the loader
     is a seed, so becoming one costs no second registration and writes are never granted to anyone.
     The same thread then faults the host pages in (MADV_POPULATE_WRITE) a piece at a time, and reads
     wait for that front: a read into never-touched pages takes every fault inside the transport's
     kernel copy, several times slower. Pieces already resident (a framework's initialised tensors)
     are skipped after a mincore check. On a VM that hands freed memory back to its host, this
     first touch bounds a load into fresh memory (phases `prefault` and `prefault_wait`);
  2. reads of up to `chunk_bytes` in address order, handed to the engine as ops of up to
     `max_inflight`/2 read slots each, at most `max_inflight` slots queued or posted (between
     max_inflight/2 and max_inflight, as ops retire in order), where a read of chunk_bytes takes one
     slot and a smaller one its share, down to 1/64 (a shard's strided pieces, a few KiB each, go
     out 256 to an op): the engine's native core posts their chunks, up to its own limit, and Python
     wakes once per op, not per read. Bytes that several destination tensors share (tied weights)
     are read once;
  3. each region's bytes are digested in order as soon as they are final (xxh3-128, the chunk still
     in cache), and every tensor is compared with the manifest. With xxh3-128 and a binding built with
     xxHash a native thread of the transport does it as reads land (`backends.DigestJob`: the reads
     carry the job; Python only compares at the end); otherwise (blake3, `native_digests=False`) a
     verifier thread here does.
GPU destinations go through pinned host bounce slots instead (`rfork.pull.staged`, over the same engine:
the loader picks which).

The engine is opened early, on a helper thread, while the planner round trip runs; after the load
the seed this instance becomes takes it over (`take_engine`), with the registrations.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from backends import DigestJob, Region, TransferEngine, native_digests_available, provider_available
from rfork.errors import PullError
from rfork.pull.options import LoadOptions, ProgressFn
from rfork.pull.read_plan import Read, ReadPlan, Span
from rfork.weights import checksum as ck
from rfork.weights.memory import prefault

log = logging.getLogger(__name__)

_PREFAULT_PIECE = 16 << 20
SMALL_READS_PER_SLOT = 64
_warmed: set[str] = set()


def warm_transport(providers: Sequence[str]) -> None:
    """Get the transport ready to open fast; call it as early as possible (a CLI at start-up).

    Asks libfabric for the first one-sided provider on a helper thread: the first fi_getinfo
    initialises every provider (about 0.1 s, GIL released), later ones are fast. (The native library
    itself is loaded when this module is imported: its dlopen holds the GIL for about 0.2 s.)
    """
    wanted = [p for p in providers if p != "nccl"][:1]
    if not wanted or wanted[0] in _warmed:
        return
    _warmed.add(wanted[0])
    threading.Thread(
        target=provider_available, args=(wanted[0],), name="rfork-transport-warm", daemon=True
    ).start()


class OneSidedReader:
    """The loader's engine (opened early, handed to the seed after) and `pull` over it. One load at a time."""

    def __init__(self, options: LoadOptions) -> None:
        self.options = options
        self._engine: TransferEngine | None = None
        self._opening: Future[TransferEngine] | None = None
        self._lock = threading.Lock()

    def open_soon(self) -> None:
        """Start opening the engine on a helper thread, so it overlaps the planner round trip."""
        with self._lock:
            if self._engine is not None or self._opening is not None:
                return
            fut: Future[TransferEngine] = Future()
            self._opening = fut
        warm_transport(self.options.one_sided)

        def opener() -> None:
            try:
                fut.set_result(self._open())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(exc)

        threading.Thread(target=opener, name="rfork-engine-open", daemon=True).start()

    def engine(self) -> TransferEngine:
        """The open engine (waits for the helper thread, or opens it here if that failed)."""
        with self._lock:
            pending, self._opening = self._opening, None
        if pending is not None:
            try:
                engine = pending.result()
            except Exception:  # noqa: BLE001 - opened again below, where the error surfaces to the caller
                log.warning("opening the engine in the background failed; trying again", exc_info=True)
            else:
                with self._lock:
                    if self._engine is None:
                        self._engine = engine
                        return engine
                engine.close()
        with self._lock:
            if self._engine is None:
                self._engine = self._open()
            return self._engine

    def take_engine(self) -> TransferEngine:
        """The engine, now owned by the caller (the seed this loader becomes)."""
        engine = self.engine()
        self._engine = None
        return engine

    def fence(self) -> None:
        """After a failed attempt: make sure none of its reads can still land. A read that timed out
        stays posted, and lands if its seed wakes up (SIGCONT, a healed partition), possibly after the
        same memory was filled and verified from another source. When any is outstanding the engine is
        closed (its endpoints go, so late data finds nobody to write it) and the next attempt opens a
        fresh one; registrations made on the closed engine are gone with it."""
        with self._lock:
            engine = self._engine
            if engine is None or engine.outstanding() == 0:
                return
            self._engine = None
        log.warning(
            "%d read(s) of a failed attempt still posted: closing the engine so none can land later",
            engine.outstanding(),
        )
        engine.close()

    def close(self) -> None:
        """Close the engine unless a seed took it."""
        with self._lock:
            pending, self._opening = self._opening, None
            engine, self._engine = self._engine, None
        if pending is not None:
            with contextlib.suppress(Exception):
                pending.result().close()
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.close()

    def read(
        self,
        plan: ReadPlan,
        *,
        deadline: float,
        progress: ProgressFn | None,
        phases: dict[str, float],
    ) -> list[Region]:
        """Read and verify every tensor of the plan's destination into host memory; fills `phases`.

        Returns the local registrations (one per destination region, read-only) for the seed this
        instance becomes. PullError, before anything is connected, when a descriptor's fabric address
        is outside RFORK_SEED_NETWORKS.
        """
        plan.check_addresses()
        pipeline = _ReadPipeline(self.engine(), plan, self.options, deadline, progress)
        try:
            return pipeline.run()
        finally:
            phases.update(pipeline.phases)

    def _open(self) -> TransferEngine:
        opts = self.options
        return TransferEngine((opts.one_sided or ["tcp"])[0], opts.domains, timeout_s=opts.transfer_timeout_s)


@dataclass(slots=True)
class _Digesting:
    """A span and its running digest (fed in order as its bytes become final)."""

    span: Span
    digest: ck.StreamingDigest
    done: bool = False

    @property
    def offset(self) -> int:
        return self.span.offset

    @property
    def end(self) -> int:
        return self.span.end


class _Faulted:
    """How far each destination region is pre-faulted: the registration thread raises the marks, the
    submitting thread waits before posting a read above them."""

    def __init__(self, regions: int) -> None:
        self._upto = [0] * regions
        self._cond = threading.Condition()

    def raise_to(self, region: int, upto: int) -> None:
        with self._cond:
            self._upto[region] = upto
            self._cond.notify_all()

    def finish(self) -> None:
        """No more pre-faulting (done, not wanted, or stopped): nothing waits any more."""
        with self._cond:
            self._upto = [1 << 62] * len(self._upto)
            self._cond.notify_all()

    def front(self, region: int) -> int:
        """Bytes of the region pre-faulted so far (reads below may go out)."""
        return self._upto[region]

    def wait(self, region: int, upto: int, timeout_s: float) -> None:
        if self._upto[region] >= upto:
            return
        with self._cond:
            if not self._cond.wait_for(lambda: self._upto[region] >= upto, timeout=timeout_s):
                raise TimeoutError("deadline")


class _ReadPipeline:
    """One rank from one seed over one-sided reads into host memory (see the module docstring)."""

    def __init__(
        self,
        engine: TransferEngine,
        plan: ReadPlan,
        opts: LoadOptions,
        deadline: float,
        progress: ProgressFn | None,
    ) -> None:
        self.engine = engine
        self.plan = plan
        self.dest = plan.dest
        self.opts = opts
        self.deadline = deadline
        self.progress = progress
        self.phases: dict[str, float] = {}
        self._verify_s = 0.0
        self._verify_failed = False  # a _verify_upto raised: the spans' digests are no longer in step
        self._prefault_s = 0.0  # written by the registration thread, read after it is joined
        algorithm = self.dest.checksum_algorithm
        if algorithm not in ck.HOST_ALGORITHMS:
            raise PullError(
                f"rank {plan.rank}: one-sided reads verify host digests"
                f" ({', '.join(ck.HOST_ALGORITHMS)}) only, not {algorithm}"
            )
        self._spans = [
            [_Digesting(span, ck.StreamingDigest(algorithm)) for span in spans]
            for spans in plan.spans_by_region()
        ]

    def run(self) -> list[Region]:
        """Pull and verify every tensor; the local registrations, one per destination region."""
        dest = self.dest
        self.plan.accept_empty()
        remote = self.plan.remote()
        plan = self.plan.reads(self.opts.chunk_bytes)
        total = sum(r.nbytes for reads in plan for r in reads)
        job = self._digest_job(plan)
        done_bytes = 0
        reg_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rfork-register")
        verify_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rfork-verify")
        verify_futs: list[Future[None]] = []
        targets = dest.registrables()
        reg_futs: list[Future[Region]] = [Future() for _ in targets]
        stop_prefault = threading.Event()
        faulted = _Faulted(len(targets))
        reg_pool.submit(self._register_all, targets, reg_futs, stop_prefault, faulted)
        frontier = [0] * len(plan)  # per region: reads[:frontier] are all done
        final_at = [0] * len(plan)  # per region: bytes below this are final
        t_first = time.perf_counter()
        reg_wait = 0.0
        fault_wait = 0.0
        inflight: deque[tuple[Future[None], list[Read]]] = deque()  # ops: their reads, one region each
        # in flight, counted in read slots: a read of chunk_bytes takes one, a smaller one a share down to
        # 1/SMALL_READS_PER_SLOT of one, so that the pieces of a shard's strided stripes (a few KiB each)
        # keep the wire as busy as whole chunks do
        queued = 0.0  # slots of the reads in those ops
        per_op = max(1, self.opts.max_inflight // 2)
        chunk = self.opts.chunk_bytes

        def slot(rd: Read) -> float:
            return max(rd.nbytes / chunk, 1 / SMALL_READS_PER_SLOT)

        def slots(batch: Sequence[Read]) -> float:
            return sum(slot(rd) for rd in batch)
        local_regions: list[Region] = []
        ok = False
        verified = 0  # verify_futs[:verified] completed without error

        def retire() -> int:
            nonlocal queued, verified
            fut, batch = inflight.popleft()
            fut.result(timeout=self._left())
            queued -= slots(batch)
            # a tensor that failed its check fails the pull now, not after the seed sent everything
            while verified < len(verify_futs) and verify_futs[verified].done():
                verify_futs[verified].result()
                verified += 1
            nbytes = sum(rd.nbytes for rd in batch)
            if job is not None:
                return nbytes  # their bytes were handed to the job before the future resolved
            for rd in batch:
                rd.done = True
            rd = batch[-1]
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
            return nbytes

        try:
            for region, reads in enumerate(plan):
                t_reg = time.perf_counter()
                local = reg_futs[region].result(timeout=self._left())
                reg_wait += time.perf_counter() - t_reg
                local_regions.append(local)
                if not reads and job is None:
                    size = dest.layout.region_sizes[region]
                    verify_futs.append(verify_pool.submit(self._verify_upto, region, 0, size))
                k = 0
                while k < len(reads):
                    t_fault = time.perf_counter()
                    faulted.wait(region, reads[k].offset + reads[k].nbytes, self._left())
                    fault_wait += time.perf_counter() - t_fault
                    # one op: the next reads that the pre-fault front has passed, up to per_op slots
                    front, j, taken = faulted.front(region), k + 1, slot(reads[k])
                    while j < len(reads) and reads[j].offset + reads[j].nbytes <= front:
                        taken += slot(reads[j])
                        if taken > per_op:
                            break
                        j += 1
                    batch = reads[k:j]
                    while inflight and queued + slots(batch) > self.opts.max_inflight:
                        done_bytes += retire()
                        self._report(done_bytes, total)
                    parts = [
                        self.engine.read_part(
                            local, rd.offset, rd.nbytes, remote[rd.src_region], rd.src_offset, digest=job
                        )
                        for rd in batch
                    ]
                    inflight.append((self.engine.start_op("read", parts).future, batch))
                    queued += slots(batch)
                    k = j
            while inflight:
                done_bytes += retire()
                self._report(done_bytes, total)
            t_last = time.perf_counter()
            for vf in verify_futs:
                vf.result(timeout=self._left())
            if job is not None:
                self._check_native(job)
            if self.plan.strided:  # a shard's stripes along dims > 0: every piece is read by now
                t_strided = time.perf_counter()
                self.plan.accept_strided()
                self._verify_s += time.perf_counter() - t_strided
            t_end = time.perf_counter()
            # every read is done, so what is left to pre-fault (padding past the last read) is not needed;
            # the thread is joined so that its figure can be read
            stop_prefault.set()
            reg_pool.shutdown(wait=True)
            self.phases.update(
                register=reg_wait,
                transfer=t_last - t_first - reg_wait,
                prefault=self._prefault_s,
                prefault_wait=fault_wait,
                verify=self._verify_s,
                verify_tail=t_end - t_last,
            )
            log.info(
                "rank %d: register wait %.3f s, transfer %.3f s (%.2f GB/s; %.3f s of it waiting for the "
                "pre-fault, which took %.3f s), verify %.3f s (%s), %.3f s of it after the last read",
                dest.rank,
                reg_wait,
                self.phases["transfer"],
                total / max(t_last - t_first, 1e-9) / 1e9,
                fault_wait,
                self._prefault_s,
                self._verify_s,
                "native, as reads landed" if job is not None else "verifier thread",
                t_end - t_last,
            )
            ok = True
            return local_regions
        except TimeoutError as exc:
            raise PullError(f"rank {dest.rank}: deadline passed") from exc
        finally:
            if job is not None:
                job.release()  # nothing is hashed from here on: the destination may be reused
            stop_prefault.set()
            faulted.finish()
            for fut, _ in inflight:
                fut.cancel()
            # a signal (Ctrl-C, SIGTERM): no waiting out reads stuck on a stalled seed (up to the transfer
            # timeout); the caller closes the engine next, which keeps whatever is still posted to open
            # memory, and the lease is reported at once
            stopping = isinstance(sys.exc_info()[1], KeyboardInterrupt)
            if not ok and not stopping:
                # outstanding reads may still land in these buffers: wait them out before releasing
                for fut, _ in inflight:
                    with contextlib.suppress(Exception):
                        fut.exception(timeout=max(self._left(), 1.0))
                for f in reg_futs:
                    with contextlib.suppress(Exception):
                        self.engine.deregister(f.result(timeout=30))
            reg_pool.shutdown(wait=True)  # its thread uses the engine, which a fence may close next
            verify_pool.shutdown(wait=True, cancel_futures=not ok)

    def _digest_job(self, plan: list[list[Read]]) -> DigestJob | None:
        """The native digest job for this pull, or None where the verifier thread digests."""
        if not (
            self.opts.native_digests
            and not self.plan.strided  # the job digests spans, which those pieces are not
            and self.dest.checksum_algorithm == ck.XXH3_128
            and native_digests_available()
        ):
            return None
        dest = self.dest
        return DigestJob(
            [(dest.ranges[q].ptr, size) for q, size in enumerate(dest.layout.region_sizes)],
            [[(rd.offset, rd.nbytes) for rd in reads] for reads in plan],
            [[(sp.offset, sp.end) for sp in spans] for spans in self._spans],
        )

    def _check_native(self, job: DigestJob) -> None:
        """Wait for the job's last hashes, then compare every span with the manifest."""
        job.wait(self._left())
        self._verify_s = job.hash_seconds
        spans = [sp for region in self._spans for sp in region]
        for span, digest in zip(spans, job.hexdigests(), strict=True):
            span.done = True
            self.plan.accept(span.span.names, digest)

    def _verify_upto(self, region: int, lo: int, hi: int) -> None:
        """Digest region bytes [lo, hi) (final now, fed in order) and check every span that ends by hi.

        Each span's digest is fed from where it stopped, so every call must feed every span it
        overlaps. Once one call raised (a checksum mismatch), the spans after the failing one were
        not fed: later calls would hash from the wrong offset (a span that ended before lo: a negative
        length, which the hashers read as a huge one), so they do nothing; the first error fails the
        pull."""
        if self._verify_failed:
            return
        t = time.perf_counter()
        try:
            base = self.dest.ranges[region].ptr
            for span in self._spans[region]:
                if span.done or span.offset >= hi:
                    continue
                self._feed(region, span, base, lo, hi)
                if span.end <= hi:
                    self._check(span)
        except BaseException:
            self._verify_failed = True
            raise
        finally:
            self._verify_s += time.perf_counter() - t

    def _feed(self, region: int, span: _Digesting, base: int, lo: int, hi: int) -> None:
        """Feed the span's bytes in [lo, hi) of the region at `base`: its digest must have stopped at
        lo (or not started, where the span starts after lo); PullError if not."""
        start = span.offset + span.digest.fed
        if start != max(span.offset, lo):  # (when equal: start <= min(span.end, hi))
            raise PullError(
                f"rank {self.dest.rank}: verifier out of step at region {region} bytes"
                f" [{lo}, {hi}): span [{span.offset}, {span.end}) fed up to {start}"
            )
        span.digest.update(base + start, min(span.end, hi) - start)

    def _check(self, span: _Digesting) -> None:
        span.done = True
        self.plan.accept(span.span.names, span.digest.hexdigest())

    def _register_all(
        self, targets: Sequence[Any], futs: Sequence[Future[Region]], stop: threading.Event, faulted: _Faulted
    ) -> None:
        """Register every destination region read-only (in order: reads of region i start as soon as it
        is), then pre-fault the host ones in order, a piece at a time, raising `faulted` as it goes."""
        try:
            for target, fut in zip(targets, futs, strict=True):
                try:
                    fut.set_result(self.engine.register(target, access="read"))
                except BaseException as exc:  # noqa: BLE001 - handed to the pipeline, which fails the attempt
                    fut.set_exception(exc)
                    for rest in futs:
                        if not rest.done():
                            rest.set_exception(
                                PullError(f"rank {self.dest.rank}: an earlier region did not register")
                            )
                    return
            if not self.opts.prefault:
                return
            for region, target in enumerate(targets):
                if isinstance(target, torch.Tensor) and target.device.type != "cpu":
                    continue  # device memory: nothing to fault in here
                ptr, nbytes = target if isinstance(target, tuple) else (target.data_ptr(), target.nbytes)
                for off in range(0, int(nbytes), _PREFAULT_PIECE):
                    if stop.is_set():
                        return
                    t = time.perf_counter()
                    prefault(int(ptr) + off, min(_PREFAULT_PIECE, int(nbytes) - off))
                    self._prefault_s += time.perf_counter() - t
                    faulted.raise_to(region, off + _PREFAULT_PIECE)
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
