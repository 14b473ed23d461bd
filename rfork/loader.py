"""The Loader: a rank's weights from a seed (one-sided reads), else NCCL, else disk; verified; then a seed.

The story of one load, for each rank:
  1. ask the planner for a source (`planner_session`: waits out busy seeds, trusts only manifests
     that match the identity's anchored digests);
  2. check the destination against the seed's manifest and plan the read once (`read_plan`), then
     pick the reader that takes it (`one_sided`, `staged` for GPU destinations, `nccl`), each
     verifying every tensor's digest as it lands; report how it went; on any failure report it,
     fence the failed attempt's reads (none may land later: `OneSidedReader.fence`), exclude that
     seed and ask again; when no seed is left, read the checkpoint (`disk`);
  3. once every rank is in, hand over what a seed serves (`LoadResult`: per rank the weights, their
     read-only registrations and verified digests, `ServedRank`; the engine they live on) and publish
     this instance as a seed of the same weights (`Seed.adopt`): nothing is registered twice. With
     `seed_later` the result holds them until the caller has the seed adopt it (the framework hooks,
     after the framework's post-load steps) or closes it.
Weights land where the caller wants them: `pull_into(named_tensors)` / `load_into(module)` fill the
caller's own tensors; `load()` allocates flat buffers per the seed's manifest first (its result's
`assign_to(module)` points a module at them). Nothing is published before every tensor of every rank
verified; a disk load says `verified=False`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from backends import BackendUnavailable, Region
from planner.contract import RankManifest
from rfork import metrics
from rfork.errors import ConfigurationError, DestinationMismatch, PullError, SeedRequired
from rfork.identity import SourceIdentity
from rfork.pull.checks import check_planner_url, check_provider_names
from rfork.pull.disk import load_from_disk
from rfork.pull.keep import Split, merge, split_matching, split_shared
from rfork.pull.nccl import pull_nccl
from rfork.pull.one_sided import OneSidedReader
from rfork.pull.options import BusyWait, LoadOptions, ProgressFn
from rfork.pull.planner_session import PlannerSession, Source
from rfork.pull.progress_report import PullProgress
from rfork.pull.read_plan import ReadPlan
from rfork.pull.result import Attempt, LoadResult, ServedRank
from rfork.pull.staged import pull_staged
from rfork.seed.seed import Seed
from rfork.weights.checkpoint import CheckpointInfo, read_checkpoint_info
from rfork.weights.rank_weights import RankWeights
from rfork.weights.stripes import whole_identity

log = logging.getLogger(__name__)


class Loader:
    """Load the ranks of one identity; see the module docstring. Not thread-safe; one load at a time.

    `token` acts for the load (assignments, reports); `register_token` for becoming a seed (default:
    `token`). `checkpoint` is the disk fallback (and the estimate the planner weighs waiting against).
    """

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
        self.planner_url = planner_url = check_planner_url(planner_url)  # a typo is fatal, not a disk load
        self.register_token = register_token or token
        if checkpoint is not None and not isinstance(checkpoint, CheckpointInfo):
            checkpoint = read_checkpoint_info(checkpoint)
        self.checkpoint = checkpoint
        self.options = options or LoadOptions()
        check_provider_names(self.options.providers)
        self.progress = progress
        self.planner = PlannerSession(
            planner_url=planner_url,
            token=token,
            identity=identity,
            options=self.options,
            fallback_bytes=None if checkpoint is None else checkpoint.total_bytes,
        )
        self.reader = OneSidedReader(self.options)
        self._token = token

    def prepare(self) -> None:
        """Start opening the engine (helper thread) and create the planner client now, so both overlap
        with whatever the caller does next (building the model); load/pull_into use them."""
        if self.options.one_sided and self.planner_url is not None:
            self.reader.open_soon()
        _ = self.planner.client

    def load(self, ranks: Sequence[int] | None = None) -> LoadResult:
        """Load every rank (default all of the identity's world) into buffers allocated per the seed's
        manifest, verify, and (by default) become a seed. Prefer `pull_into` when the tensors exist."""
        ranks = list(range(self.identity.world_size)) if ranks is None else list(ranks)
        return self._run(dict.fromkeys(ranks))

    def pull_into(
        self,
        named_tensors: Mapping[str, torch.Tensor],
        *,
        rank: int = 0,
        held_digests: Mapping[str, str] | None = None,
    ) -> LoadResult:
        """Pull one rank straight into the caller's tensors (no copy, nothing allocated), verify, and
        (by default) serve them as a seed.

        The tensors must be contiguous, on one device, and match the manifest's names, dtypes and
        shapes (else DestinationMismatch naming the first bad tensor, before any byte moves). Tied or
        shared tensors are pulled once. On failure: the next candidate, then NCCL, then the disk
        checkpoint, all into the same tensors; the tensors' contents are undefined after an error.

        With `keep_matching` (a rollout) tensors whose bytes already have the seed's digest are kept;
        `held_digests` are the digests of what the tensors hold now as a verified load or seed recorded
        them (`LoadResult.ranks[rank].weights.checksums`), trusted instead of hashing those again: pass
        them only if nothing has written to the tensors since.
        """
        return self._run(
            {rank: RankWeights.from_tensors(rank=rank, tensors=named_tensors)}, {rank: held_digests or {}}
        )

    def load_into(self, module: torch.nn.Module, *, rank: int = 0) -> LoadResult:
        """`pull_into` the module's own parameters and persistent buffers (its state dict names)."""
        return self.pull_into(module.state_dict(keep_vars=True), rank=rank)

    def _run(
        self, dests: Mapping[int, RankWeights | None], held: Mapping[int, Mapping[str, str]] | None = None
    ) -> LoadResult:
        t0 = time.perf_counter()
        held = held or {}
        self.planner.seconds = 0.0
        if self.options.one_sided and self.planner_url is not None:
            self.reader.open_soon()
        ranks: dict[int, ServedRank] = {}
        attempts: list[Attempt] = []
        sources: set[str] = set()
        moved = kept = 0
        try:
            for rank, dest in dests.items():
                served, source, nbytes, kept_bytes = self._load_rank(rank, dest, held.get(rank), attempts)
                ranks[rank] = served
                sources.add(source)
                moved += nbytes
                kept += kept_bytes
        except BaseException:
            self.reader.close()
            raise
        self.reader.fence()  # nothing this load posted may land after it returns
        seconds = time.perf_counter() - t0
        result = LoadResult(
            identity=self.identity,
            ranks=ranks,
            source=next(iter(sources)) if len(sources) == 1 else "mixed",
            bytes=moved,
            kept_bytes=kept,
            seconds=seconds,
            verified="disk" not in sources,
            attempts=attempts,
            phases=_phases(attempts, self.planner.seconds, seconds),
        )
        log.debug("load phases (s): %s", ", ".join(f"{k} {v:.3f}" for k, v in result.phases.items()))
        log.info(
            "loaded %d rank(s), %d bytes (%d kept), from %s in %.3f s (%.2f GB/s), %s",
            len(ranks),
            result.bytes,
            result.kept_bytes,
            result.source,
            seconds,
            result.bytes / max(seconds, 1e-9) / 1e9,
            "all checksums verified" if result.verified else "not verified (disk: nothing to compare with)",
        )
        if self.planner_url is None or not (self.options.become_seed or self.options.seed_later):
            self.reader.close()
            for served in ranks.values():
                served.regions = []  # gone with the engine
            return result
        try:
            # the seed adopts the engine with the pull's registrations: nothing is registered twice
            result.engine = self.reader.take_engine()
            result.client = self.planner.client
            if self.options.become_seed:
                self._become_seed(result)
        except Exception as exc:  # noqa: BLE001 - the weights are loaded: a refused publication must not lose them
            result.seed_error = f"{type(exc).__name__}: {exc}"
            result.close()
            self.reader.close()
            log.warning("loaded, but could not become a seed (serving nothing): %s", result.seed_error)
            log.debug("becoming a seed failed", exc_info=True)
        return result

    def _load_rank(
        self,
        rank: int,
        dest: RankWeights | None,
        held: Mapping[str, str] | None,
        attempts: list[Attempt],
    ) -> tuple[ServedRank, str, int, int]:
        """One rank from the first source that works (into `dest`, or into buffers per the manifest),
        with the registrations its reads landed through ([] where it made none); the bytes it moved and
        those it kept (`keep_matching`, trusting `held` digests). Every source tried goes to `attempts`,
        seeds of other identities that served part of it (a rollout's earlier version) included."""
        for source in self.planner.sources(rank):
            started = time.perf_counter()
            phases: dict[str, float] = {}
            shared: list[Attempt] = []  # reads from other identities' seeds during this attempt
            try:
                served, nbytes, kept = self._pull(source, rank, dest, held, phases, shared)
            except DestinationMismatch as exc:
                # The caller's tensors disagree with a manifest of the same identity: every source would.
                source.failed(exc, 0.0)
                raise
            except Exception as exc:  # noqa: BLE001 - any failure moves on to the next candidate
                seconds = time.perf_counter() - started
                metrics.pull_finished(source=source.name, outcome="failure")
                if isinstance(exc, ConfigurationError):  # this machine cannot speak the provider
                    source.failed(exc, seconds)
                    raise
                log.warning(
                    "rank %d from seed %s (%s) failed after %.3f s, trying the next source: %s",
                    rank,
                    source.instance_id,
                    source.name,
                    seconds,
                    exc,
                )
                attempts.extend(shared)
                attempts.append(source.attempt(seconds, error=exc, phases=phases))
                source.failed(exc, seconds)
                self.reader.fence()  # before anything else writes into the same memory
                continue
            except BaseException as exc:  # a signal (Interrupted, KeyboardInterrupt): free the slot now
                source.aborted(exc, time.perf_counter() - started)
                metrics.pull_finished(source=source.name, outcome="aborted")
                raise
            seconds = time.perf_counter() - started
            attempts.extend(shared)  # what other identities' seeds served of it, or failed to
            own = nbytes - sum(a.bytes for a in shared if a.ok)
            attempts.append(source.attempt(seconds, nbytes=own, phases=phases))
            source.succeeded(own, seconds)
            metrics.pull_finished(source=source.name, outcome="success", nbytes=nbytes, seconds=seconds)
            if "verify" in phases:
                metrics.VERIFY_SECONDS.observe(phases["verify"] + phases.get("verify_tail", 0.0))
            log.info(
                "rank %d: %d bytes from %s via %s in %.3f s, verified",
                rank,
                nbytes,
                source.instance_id,
                source.name,
                seconds,
            )
            served.weights.origin = "peer"
            return served, source.name, nbytes, kept
        kind, why = self.planner.miss or ("no_seed", "no seed served it")
        sharded = self._load_shard(rank, dest, attempts, kind)
        if sharded is not None:
            return sharded
        metrics.fell_back(kind)
        if self.options.require_seed:
            raise SeedRequired(
                f"rank {rank}: no seed served it ({why}); require_seed forbids loading from disk"
            )
        if self.planner_url is None:
            log.info("rank %d: loading from disk (no planner given)", rank)
        else:
            log.warning("rank %d: loading from disk: %s", rank, why)
        t_disk = time.perf_counter()
        weights = load_from_disk(
            self.checkpoint,
            rank=rank,
            tp=self.identity.tp,
            dest=dest,
            attempts=attempts,
            progress=self.progress,
        )
        metrics.pull_finished(
            source="disk",
            outcome="success",
            nbytes=weights.layout.total_bytes,
            seconds=time.perf_counter() - t_disk,
        )
        return ServedRank(weights=weights), "disk", weights.layout.total_bytes, 0

    def _load_shard(
        self, rank: int, dest: RankWeights | None, attempts: list[Attempt], miss: str
    ) -> tuple[ServedRank, str, int, int] | None:
        """Where no seed of this identity served the rank (`miss`, the kind): its TP slice from a seed of
        the whole tensors (`whole_identity`), each stripe verified (`ReadPlan.check_shard`); None where
        there is none, none served it, or no slice can be read (the caller reads the disk)."""
        whole = whole_identity(self.identity)
        if whole is None or self.planner_url is None or not self.options.one_sided:
            return None
        if miss == "planner_unreachable":  # no second wait on a planner that did not answer
            return None
        if self.options.staged_reads or (dest is not None and dest.device.type != "cpu"):
            log.info("rank %d: no TP slice from whole-tensor seeds: shards are read into host memory", rank)
            return None
        tp = self.identity.tp  # the rank is the TP rank: PP is 1 (whole_identity)
        per_rank = None if self.checkpoint is None else self.checkpoint.total_bytes // tp
        session = self.planner.about(
            whole, dataclasses.replace(self.options, allow_nccl=False, exclude=()), fallback_bytes=per_rank
        )
        try:
            for source in session.sources(0):
                started = time.perf_counter()
                phases: dict[str, float] = {}
                try:
                    manifest = source.manifest()  # checked against the anchor: a bad one is that seed's
                except Exception as exc:  # noqa: BLE001 - the next whole-tensor seed, then the disk
                    source.failed(exc, time.perf_counter() - started)
                    attempts.append(source.attempt(time.perf_counter() - started, error=exc))
                    continue
                try:
                    target = dest or RankWeights.allocate_shard(manifest, tp=tp, rank=rank)
                    plan = ReadPlan.check_shard(
                        manifest,
                        target,
                        tp=tp,
                        rank=rank,
                        require_crypto_digest=self.options.require_crypto_digest,
                    )
                except (PullError, DestinationMismatch, ConfigurationError) as exc:
                    # the anchored manifest, the same at every seed of the identity: no slice from any of them
                    source.failed(exc, time.perf_counter() - started)
                    attempts.append(source.attempt(time.perf_counter() - started, error=exc))
                    log.warning("rank %d: no TP=%d slice from whole-tensor seeds: %s", rank, tp, exc)
                    if isinstance(exc, PullError):
                        return None
                    raise
                try:
                    deadline = time.monotonic() + self.options.rank_deadline_s
                    regions = self._read(source, plan, deadline, phases)
                except Exception as exc:  # noqa: BLE001 - the next whole-tensor seed, then the disk
                    seconds = time.perf_counter() - started
                    metrics.pull_finished(source=source.name, outcome="failure")
                    source.failed(exc, seconds)
                    attempts.append(source.attempt(seconds, error=exc, phases=phases))
                    self.reader.fence()
                    log.warning(
                        "rank %d: its TP=%d slice from whole-tensor seed %s failed after %.3f s: %s",
                        rank, tp, source.instance_id, seconds, exc,
                    )
                    if isinstance(exc, ConfigurationError):
                        raise
                    continue
                except BaseException as exc:  # a signal: free the seed's slot now
                    source.aborted(exc, time.perf_counter() - started)
                    metrics.pull_finished(source=source.name, outcome="aborted")
                    raise
                seconds = time.perf_counter() - started
                nbytes = plan.nbytes
                attempts.append(source.attempt(seconds, nbytes=nbytes, phases=phases))
                source.succeeded(nbytes, seconds)
                metrics.pull_finished(source=source.name, outcome="success", nbytes=nbytes, seconds=seconds)
                log.info(
                    "rank %d: its TP=%d slice, %d bytes, from whole-tensor seed %s (%s) in %.3f s, verified",
                    rank, tp, nbytes, source.instance_id, source.name, seconds,
                )
                target.origin = "peer"
                return ServedRank(weights=target, regions=regions), source.name, nbytes, 0
        finally:
            self.planner.seconds += session.seconds
            session.close()
        return None

    def _pull(
        self,
        source: Source,
        rank: int,
        dest: RankWeights | None,
        held: Mapping[str, str] | None,
        phases: dict[str, float],
        shared: list[Attempt],
    ) -> tuple[ServedRank, int, int]:
        """Check the destination against the source's (checked) manifest, then read and verify it (with
        `keep_matching`, only the tensors whose bytes differ: `rfork.pull.keep`, some perhaps from other
        identities' seeds, listed in `shared`); the bytes read and kept."""
        manifest = source.manifest()
        deadline = time.monotonic() + self.options.rank_deadline_s
        fresh = dest is None
        if dest is None:
            t_alloc = time.perf_counter()
            dest = RankWeights.allocate_for(manifest)
            phases["alloc"] = time.perf_counter() - t_alloc
        plan = self._plan(manifest, dest)
        if source.name == "nccl":  # the seed streams every tensor: nothing can be kept
            pull_nccl(source.candidate, plan, timeout_s=self.options.rank_deadline_s)
            return ServedRank(weights=dest), dest.layout.total_bytes, 0
        if self.options.keep_matching and not fresh:  # the caller's tensors: they hold something
            t_keep = time.perf_counter()
            split = split_matching(dest, manifest, held)
            phases["keep"] = time.perf_counter() - t_keep
            log.info(
                "rank %d: %d bytes already match the seed's digests and stay; %d to read",
                rank,
                split.kept_bytes,
                split.read_bytes,
            )
            read_bytes = split.read_bytes
            # a destination that holds most of the rank already (a rollout in place) lacks the tensors that
            # changed, which no earlier version holds: asking the planner for one would only cost time
            if split.to_read is not None and split.read_bytes >= split.kept_bytes:
                split = self._read_shared(rank, dest, split, deadline, phases, shared)
            if split.to_read is not None:
                self._read_part(source, self._plan(split.manifest, split.to_read), deadline, phases)
            merge(dest, split)
            return ServedRank(weights=dest), read_bytes, split.kept_bytes
        regions = self._read(source, plan, deadline, phases)
        return ServedRank(weights=dest, regions=regions), dest.layout.total_bytes, 0

    def _plan(self, manifest: RankManifest, dest: RankWeights) -> ReadPlan:
        return ReadPlan.check(manifest, dest, require_crypto_digest=self.options.require_crypto_digest)

    def _read_part(self, source: Source, plan: ReadPlan, deadline: float, phases: dict[str, float]) -> None:
        """Read part of a rank (a rollout's changed or shared tensors). Its registrations cover only that
        part, so they go: a seed this instance becomes registers the whole rank."""
        regions = self._read(source, plan, deadline, phases)  # opens the engine, or names the setting
        engine = self.reader.engine()
        for region in regions:
            engine.deregister(region)

    def _read_shared(
        self,
        rank: int,
        dest: RankWeights,
        split: Split,
        deadline: float,
        phases: dict[str, float],
        attempts: list[Attempt],
    ) -> Split:
        """Read what seeds of other identities hold with the same anchored digests (a rollout's previous
        version: the planner finds them), each verified like any read and listed in `attempts`; the rest
        of `split` is left for the identity's own seed. Any failure leaves it to that seed: this only
        spares it bytes."""
        client = self.planner.client
        if client is None or self.planner_url is None:
            return split
        try:
            page = client.shared_identities(
                self.identity.key(), rank=rank, checksum_algorithm=split.manifest.checksum_algorithm, limit=3
            )
        except Exception as exc:  # noqa: BLE001 - the identity's own seed holds everything
            log.info("rank %d: no identities asked for shared tensors: %s", rank, exc)
            return split
        options = dataclasses.replace(
            self.options,
            max_attempts=1,
            allow_nccl=False,
            exclude=(),
            busy_wait=BusyWait(max_wait_s=0.0, planner_outage_s=0.0),  # busy: the own seed has it too
        )
        for item in page.items:
            session = self.planner.about(item.identity, options)
            try:
                for other in session.sources(rank):
                    started = time.perf_counter()
                    try:
                        part, rest = split_shared(split, other.manifest())
                        if part is None or part.to_read is None:
                            other.succeeded(0, time.perf_counter() - started)
                            break
                        self._read_part(other, self._plan(part.manifest, part.to_read), deadline, phases)
                    except Exception as exc:  # noqa: BLE001 - the identity's own seed reads these too
                        seconds = time.perf_counter() - started
                        other.failed(exc, seconds)
                        self.reader.fence()
                        attempts.append(other.attempt(seconds, error=exc))
                        log.warning(
                            "rank %d: shared tensors from %s failed: %s", rank, other.instance_id, exc
                        )
                        break
                    seconds = time.perf_counter() - started
                    other.succeeded(part.read_bytes, seconds)
                    dest.checksums.update(part.to_read.checksums)
                    attempts.append(other.attempt(seconds, nbytes=part.read_bytes))
                    log.info(
                        "rank %d: %d bytes it shares with %s %s from seed %s in %.3f s, verified",
                        rank,
                        part.read_bytes,
                        item.identity.model,
                        item.identity.revision,
                        other.instance_id,
                        seconds,
                    )
                    split = rest
                    break
            finally:
                session.close()
            if split.to_read is None:
                break
        return split

    def _read(
        self, source: Source, plan: ReadPlan, deadline: float, phases: dict[str, float]
    ) -> list[Region]:
        """Read the plan from the source over the one-sided engine: straight into host memory, or through
        pinned bounce slots where the destination is a GPU's (tcp and shm cannot register device memory)
        or `staged_reads` asks for it. The registrations the reads landed through ([] when staged: a seed
        this becomes registers, or mirrors, once)."""
        t_engine = time.perf_counter()
        try:
            engine = self.reader.engine()  # opened on a helper thread since prepare()
        except BackendUnavailable as exc:  # this machine cannot open the provider: a setting, no seed's fault
            raise ConfigurationError(
                f"transport provider {self.options.one_sided[0]} cannot open on this machine: {exc}",
                setting="providers",
            ) from exc
        phases["engine"] = time.perf_counter() - t_engine
        client = self.planner.client
        reporter = (
            None
            if client is None
            else PullProgress(client, source.assignment.id, forward=self.progress)  # the fleet page's tree
        )
        progress = reporter or self.progress
        threads = torch.get_num_threads()
        if self.options.pull_torch_threads:
            torch.set_num_threads(self.options.pull_torch_threads)
        try:
            if self.options.staged_reads or plan.dest.device.type == "cuda":
                if plan.shard is not None:
                    raise PullError(f"rank {plan.rank}: a shard is read into host memory only")
                pull_staged(engine, plan, deadline=deadline, progress=progress, phases=phases)
                return []
            return self.reader.read(plan, deadline=deadline, progress=progress, phases=phases)
        finally:
            torch.set_num_threads(threads)
            if reporter is not None:
                reporter.close()

    def _become_seed(self, result: LoadResult) -> None:
        """Serve the loaded weights (adopting the pull's engine and registrations) and publish them."""
        assert self.planner_url is not None
        seed = Seed.adopt(
            result,
            planner_url=self.planner_url,
            token=self.register_token,
            labels=self.options.labels,
            max_concurrent_pulls=self.options.max_concurrent_pulls,
            retry_publish=True,  # a planner outage must not throw the verified weights away
        )
        log.info("now serving as seed %s", ",".join(seed.instance_ids))
        self.planner.report_seeded(seed.instance_ids)


def _phases(attempts: Sequence[Attempt], planner_s: float, seconds: float) -> dict[str, float]:
    """Seconds per phase summed over the attempts, plus the planner's and the unaccounted rest."""
    phases: dict[str, float] = {"planner": planner_s}
    for a in attempts:
        for k, v in a.phases.items():
            phases[k] = phases.get(k, 0.0) + v
    # pulls verify and pre-fault on helper threads during the transfer, whose time includes the wait
    overlapped = {"verify", "prefault", "prefault_wait"} if "transfer" in phases else set()
    phases["other"] = max(0.0, seconds - sum(v for k, v in phases.items() if k not in overlapped))
    return {k: round(v, 4) for k, v in phases.items()}


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
    held_digests: Mapping[str, str] | None = None,
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
    ).pull_into(tensors, rank=rank, held_digests=held_digests)
