"""How to load (LoadOptions): which transports, how hard to try, how to wait for a busy seed (BusyWait),
whether to become a seed afterwards."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

ProgressFn = Callable[[int, int], None]
"""(bytes done so far, total bytes) of the current attempt."""


class BusyAnswer(Protocol):
    """What a 429 carries (planner.contract.AllBusy has these attributes)."""

    retry_after_s: float
    fallback: bool


@dataclass(frozen=True, kw_only=True)
class BusyWait:
    """The wait policy: follow Retry-After (plus up to `jitter` of it), give up after `max_wait_s`.

    A planner that cannot be reached while a loader asks (restarted, failed over) is asked again
    every `outage_retry_s` for up to `planner_outage_s` of continuous failure before the loader
    gives up on it (and falls back): a planner restart of a few seconds must not fail every loader
    that happened to ask during it (measured on the emulated fleet, docs/scale-out.md).
    """

    max_wait_s: float = 900.0
    jitter: float = 0.1
    min_sleep_s: float = 0.02
    planner_outage_s: float = 30.0
    outage_retry_s: float = 0.5

    def __post_init__(self) -> None:
        if (
            self.max_wait_s < 0
            or not 0 <= self.jitter <= 1
            or self.min_sleep_s <= 0
            or self.planner_outage_s < 0
            or self.outage_retry_s <= 0
        ):
            raise ValueError(
                f"BusyWait: need max_wait_s >= 0, 0 <= jitter <= 1, min_sleep_s > 0 (got {self})"
            )

    def decide(self, answer: BusyAnswer, waited_s: float, rng: random.Random) -> float | None:
        """Seconds to sleep before asking again, or None: stop waiting and use the fallback now."""
        if getattr(answer, "fallback", False):
            return None
        base = max(float(answer.retry_after_s), self.min_sleep_s)
        sleep = base * (1.0 + self.jitter * rng.random())
        if waited_s + sleep > self.max_wait_s:
            return None
        return sleep


@dataclass(kw_only=True)
class LoadOptions:
    """How to load: which transports, how hard to try, and whether to become a seed afterwards."""

    providers: Sequence[str] = ("tcp",)
    domains: int = 1
    chunk_bytes: int = 8 << 20
    max_inflight: int = 8
    transfer_timeout_s: float = 5.0  # the engine's dead-peer bound
    rank_deadline_s: float = 600.0
    max_attempts: int = 4
    exclude: Sequence[str] = ()
    labels: Mapping[str, str] | None = None
    become_seed: bool = True  # publish this instance as a seed right after the load
    # Without become_seed: keep the engine and the pull's registrations in the result for a seed started
    # later (`LoadResult.become_seed`; the framework hooks do, after the framework's post-load steps),
    # so nothing is registered twice. The caller then owns them: close() the result if it never seeds.
    seed_later: bool = False
    allow_nccl: bool = True
    # torch intra-op threads while a one-sided pull runs (restored after; None: leave as is). The
    # checksum gains little from a second thread but takes the core the transport's progress thread
    # (and, on one box, the seed's) needs; measured in docs/benchmarks.md.
    pull_torch_threads: int | None = 1
    # Fault destination pages in (MADV_POPULATE_WRITE) on the registration thread, ahead of the reads,
    # instead of inside the transport's receive copy.
    prefault: bool = True
    # Read through pinned host bounce slots (backends.gpu.staging). Automatic for GPU destinations,
    # as tcp and shm cannot register device memory; setting it for host destinations exercises that path.
    staged_reads: bool = False
    # xxh3-128 digests computed by a native thread of the transport as reads land
    # (backends.digest_job), instead of a Python verifier thread; where the binding has no xxHash
    # (or with blake3) the verifier thread is used either way
    native_digests: bool = True
    # 429 all_busy (rfork.pull.planner_session): wait for a seed unless the planner says the checkpoint, read
    # at `fallback_gbps` GB/s, would be sooner (None: never compare, just wait)
    busy_wait: BusyWait = field(default_factory=BusyWait)
    fallback_gbps: float | None = 2.0
    max_concurrent_pulls: int = 2  # the pull limit this instance publishes once it is a seed
    # No fallback to the disk: a rank no seed serves (planner unreachable, no seed, all busy, every pull
    # failed) raises rfork.SeedRequired naming why, for operators who would rather fail than cold-start
    require_seed: bool = False
    # Pull only under a cryptographic digest (BLAKE3): a destination whose digest is xxh3-128 or
    # pmix64-v1 (RFORK_DIGEST, rfork.weights.checksum) stops the load with a ConfigurationError
    # before any byte is pulled, and a seed's manifest or anchor under another algorithm is refused
    require_crypto_digest: bool = False
    # A rollout (rfork.pull.keep): digest the caller's tensors first and read only those whose bytes differ
    # from the seed's (anchored) digests; the rest stay, verified by that digest. For an instance that holds
    # another version of the model (pull_into / load_into; load() allocates fresh buffers and reads all).
    # Costs one local hash of the destination; the NCCL fallback streams every tensor regardless.
    keep_matching: bool = False

    @property
    def one_sided(self) -> list[str]:
        """The one-sided providers asked for ("nccl" in `providers` means: the NCCL fallback only)."""
        return [p for p in self.providers if p != "nccl"]

    @property
    def nccl(self) -> bool:
        """Whether the NCCL/gloo fallback may be used."""
        return self.allow_nccl or "nccl" in self.providers
