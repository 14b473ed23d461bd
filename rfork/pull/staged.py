"""Pulling into GPU tensors over a provider that cannot register device memory (tcp, shm here).

Each distinct destination tensor is read through a `StagedReader` (pinned host bounce slots, then a
copy to the device on a side stream) and verified on its device (the device digest, computed by the
GPU; see rfork.weights.checksum) while the next tensor is on the wire. Destination tensors may overlap
(views of one buffer): a span is verified once, when the last read that overlaps it has landed, so
the digest covers its final bytes and no later read can change a verified tensor. Nothing of the
destination is registered, so a seed this loader becomes registers (or mirrors) afresh. On a failure
(deadline, digest) the reads not yet started are cancelled, the running one is waited for, and the
error is raised: nothing lands in the destination after this returns.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from backends import StagedReader, TransferEngine
from rfork.errors import PullError
from rfork.pull.options import ProgressFn
from rfork.pull.read_plan import ReadPlan


def pull_staged(
    engine: TransferEngine,
    plan: ReadPlan,
    *,
    deadline: float,
    progress: ProgressFn | None,
    phases: dict[str, float],
) -> None:
    """Read every distinct destination tensor through bounce slots and verify it; fills `phases`.
    PullError, before anything is connected, when a descriptor's fabric address is outside
    RFORK_SEED_NETWORKS."""
    plan.check_addresses()
    dest = plan.dest
    remote = plan.remote()
    plan.accept_empty()
    total = plan.nbytes
    verify_after = _final_reads([(s.region, s.offset, s.nbytes) for s in plan.spans])
    reader = StagedReader(engine, device=dest.device)
    t_first = time.perf_counter()
    verify_s = 0.0
    futs: list[Future[int]] = []
    try:
        for span in plan.spans:
            futs.append(
                reader.read_into(
                    dest.tensors[span.names[0]], 0, span.nbytes, remote[span.src_region], span.src_offset
                )
            )
        done = 0
        for j, (span, fut) in enumerate(zip(plan.spans, futs, strict=True)):
            fut.result(timeout=max(deadline - time.monotonic(), 0.0))
            done += span.nbytes
            if progress is not None:
                progress(done, total)
            t = time.perf_counter()
            for i in verify_after.get(j, ()):
                plan.accept_span(plan.spans[i])
            verify_s += time.perf_counter() - t
    except TimeoutError as exc:
        raise PullError(f"rank {dest.rank}: deadline passed") from exc
    finally:
        for fut in futs:
            fut.cancel()  # a no-op for reads done or running; after a failure, the rest never start
        reader.close()  # waits out the read still running: the bounce slots and destination are quiet after
    phases.update(transfer=time.perf_counter() - t_first - verify_s, verify=verify_s)


def _final_reads(spans: list[tuple[int, int, int]]) -> dict[int, list[int]]:
    """For spans (region, offset, nbytes) read in list order: {read j: the spans whose bytes are final
    once reads 0..j have landed}. A span is final after the last read of its group of overlapping
    spans (connected through overlaps; a sweep in offset order, O(n log n)); a lone span, at once."""
    after: dict[int, list[int]] = {}
    group: list[int] = []
    group_region, group_end = -1, -1

    def close() -> None:
        if group:
            after.setdefault(max(group), []).extend(sorted(group))

    for i in sorted(range(len(spans)), key=lambda k: spans[k][:2]):
        region, offset, nbytes = spans[i]
        if region != group_region or offset >= group_end:
            close()
            group, group_region, group_end = [], region, offset + nbytes
        group.append(i)
        group_end = max(group_end, offset + nbytes)
    close()
    return after
