"""What a load is asked to do (LoadOptions) and what it produced (LoadResult, one Attempt per source).

A LoadResult is also the hand-off to the seed the instance becomes: per rank the weights, their
read-only registrations and the verified digests (`ServedRank`), plus the engine those registrations
live on and the planner client, held until a Seed adopts them (`become_seed`) or `close()`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from rfork.identity import SourceIdentity
from rfork.seed.seed import RankServer, Seed, ServedRank
from rfork.weights.rank_weights import RankWeights

if TYPE_CHECKING:
    from backends import TransferEngine
    from planner.contract import PlannerClient
    from rfork.compile_cache.shelf import CacheShelf

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


@dataclass(kw_only=True)
class Attempt:
    """One source tried for one rank: which, whether it worked, its figures."""

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
    """What a load produced: per rank what a seed serves (`ranks`: the weights, their registrations,
    the verified digests), how, and the seed it became. `verified` is true only when every tensor's
    digest was compared with a seed's.

    Until it becomes a seed (or with `seed_later`, until `become_seed`) it holds the engine the
    registrations live on; `close()` releases whatever it still holds.
    """

    identity: SourceIdentity
    ranks: dict[int, ServedRank]
    source: str
    bytes: int  # read from the sources (a rollout: only the tensors that differed)
    seconds: float
    verified: bool
    kept_bytes: int = 0  # already in the destination with the right digest (`LoadOptions.keep_matching`)
    attempts: list[Attempt] = field(default_factory=list)
    seed: Seed | None = None
    # why becoming a seed failed (the load itself succeeded); None when it did not fail or was not asked
    seed_error: str | None = None
    # Seconds per phase, summed over ranks: planner (assignment + report round trips), alloc (destination
    # buffers), register (main thread blocked on registration), transfer (first read posted -> last read
    # done), prefault (faulting fresh destination pages in on the registration thread, overlapped with
    # transfer), prefault_wait (the part of transfer that reads waited for it: first touch of fresh
    # memory), verify (checksum work on the verifier thread, mostly overlapped with transfer), verify_tail
    # (waiting for the verifier after the last read), engine (opening the transfer engine), read (disk),
    # other (the rest of `seconds`: manifest parsing, views, ...).
    phases: dict[str, float] = field(default_factory=dict)
    # held for the seed this load becomes: the engine the ranks' registrations are on, the planner client
    engine: TransferEngine | None = field(default=None, repr=False)
    client: PlannerClient | None = field(default=None, repr=False)

    @property
    def weights(self) -> dict[int, RankWeights]:
        """Each rank's weights (the caller's tensors, or buffers + views)."""
        return {rank: served.weights for rank, served in self.ranks.items()}

    def state_dict(self, rank: int = 0) -> dict[str, torch.Tensor]:
        """Rank `rank`'s tensors by name."""
        return self.ranks[rank].weights.tensors

    def assign_to(self, module: torch.nn.Module, rank: int = 0) -> None:
        """Point the module's parameters at the loaded views (no copy): `load_state_dict(assign=True)`.

        For `load()` results; `Loader.load_into(module)` pulls into the module's own tensors instead.
        """
        module.load_state_dict(self.state_dict(rank), strict=True, assign=True)

    def become_seed(
        self,
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
        """Serve and publish the loaded ranks (or `weights`, when what is served is not what was pulled),
        adopting the held engine with its registrations: nothing registered before is registered again.
        `providers`: more engines to serve on (the held one covers the load's provider). The seed is
        `self.seed` from here on (close() drains it); on failure it is closed, the engine with it."""
        if self.seed is not None:
            raise RuntimeError("this load is a seed already")
        if weights is not None and sorted(w.rank for w in weights) != sorted(self.ranks):
            raise ValueError(f"serve the loaded ranks {sorted(self.ranks)}, not {[w.rank for w in weights]}")
        server = self._take_server()
        seed = Seed(
            weights=list(weights) if weights is not None else [s.weights for s in self.ranks.values()],
            identity=self.identity,
            planner_url=planner_url,
            token=token,
            providers=providers,
            labels=labels,
            timeout_s=timeout_s,
            max_concurrent_pulls=max_concurrent_pulls,
            servers=[server] if server is not None else None,
            retry_publish=retry_publish,
            compile_caches=compile_caches,
            client=self.client,
        )
        seed.start()  # closes itself (and the adopted engine) if it fails
        self.seed = seed
        return seed

    def close(self) -> None:
        """Stop serving as a seed (drain, deregister), if this load became one; else release the engine
        and registrations held for one."""
        if self.seed is not None:
            self.seed.close()
            self.seed = None
        server = self._take_server()
        if server is not None:
            server.close()

    def _take_server(self) -> RankServer | None:
        """The held engine with the ranks registered on it, now owned by the caller."""
        engine, self.engine = self.engine, None
        if engine is None:
            return None
        server = RankServer(engine=engine, ranks=self.ranks.values())
        for served in self.ranks.values():
            if served.weights.rank not in server.ranks:
                served.regions = []  # on an engine a fence closed: gone with it
        return server
