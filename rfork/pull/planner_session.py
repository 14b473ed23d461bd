"""A loader's side of the planner: ask for a source for each rank, wait out 429s, report every pull.

`PlannerSession.sources(rank)` yields one `Source` per assignment, one-sided providers first and NCCL
only when no one-sided provider is shared. The loader pulls from it and says how that went
(`Source.succeeded` / `Source.failed`); the report ends the planner's lease, and after a failure the
seed is excluded and the planner asked again, up to `max_attempts`. A planner that cannot be reached
ends the sequence: the loader falls back to its checkpoint.

A candidate's manifest is trusted only when its digest set is the one the planner anchored for the
identity (planner.contract.integrity): a seed cannot vouch for its own corrupted bytes.

Busy seeds (429 `all_busy`): the loader sleeps the planner's Retry-After and falls back only when
told. The planner (planner.burst) computes Retry-After from the busy seeds' live leases and the
recorded pull rates, and sets `fallback` when the requester's own estimate (`fallback_s`, sent with
the request) beats waiting for a seed. A small jitter spreads a burst of waiters; `max_wait_s` bounds
the whole wait. `BusyWait.decide` is the decision alone (the scale-out simulator uses it on
simulated time); `ask_with_wait` is the blocking loop.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from backends import BackendUnavailable, TransferError
from planner.contract import (
    AllBusy,
    Anchor,
    Assignment,
    AuthError,
    BadRequest,
    Candidate,
    NoSource,
    NotFound,
    PlannerClient,
    PlannerUnavailable,
    ProtocolMismatch,
    RankManifest,
    digest_set,
)
from rfork.errors import ChecksumMismatch, ConfigurationError, ManifestError, PullError
from rfork.identity import SourceIdentity, default_labels
from rfork.pull.options import BusyWait, LoadOptions
from rfork.pull.result import Attempt

log = logging.getLogger(__name__)

T = TypeVar("T")


def fallback_seconds(nbytes: int, gbps: float | None) -> float | None:
    """A loader's estimate of its fallback load (bytes at `gbps` GB/s); None when it has no fallback."""
    if not gbps or gbps <= 0 or nbytes <= 0:
        return None
    return nbytes / (gbps * 1e9)


def ask_with_wait(
    ask: Callable[[float], T],
    *,
    policy: BusyWait,
    busy_type: type[BaseException],
    what: str,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    outage_type: type[BaseException] | None = None,
    since: float | None = None,
) -> T | None:
    """Call `ask(seconds waited so far)` until it returns; on `busy_type` (429) sleep as `policy`
    decides; None = fall back. On `outage_type` (the planner unreachable) ask again every
    `policy.outage_retry_s` until it has failed for `policy.planner_outage_s` in a row, then raise it.
    `since`: the `clock()` value the wait counts from (an earlier attempt's start: see PlannerSession)."""
    rng = rng or random.Random()
    started = clock() if since is None else since
    down_since: float | None = None
    while True:
        try:
            answer = ask(clock() - started)
        except busy_type as exc:
            down_since = None
            waited = clock() - started
            pause = policy.decide(exc, waited, rng)  # type: ignore[arg-type]
            if pause is None:
                log.info(
                    "%s: every seed busy after %.1f s of waiting (%s); falling back",
                    what,
                    waited,
                    "planner says the fallback is sooner" if getattr(exc, "fallback", False) else "limit",
                )
                return None
            log.info("%s: every seed busy; asking again in %.2f s", what, pause)
            sleep(pause)
        except BaseException as exc:
            if outage_type is None or not isinstance(exc, outage_type):
                raise
            now = clock()
            first = down_since is None
            down_since = now if down_since is None else down_since
            if now - down_since >= policy.planner_outage_s:
                raise
            if first:  # said once; the fallback that may follow is the warning
                log.info(
                    "%s: planner unreachable (%s); asking again every %.1f s for up to %.0f s",
                    what, exc, policy.outage_retry_s, policy.planner_outage_s,
                )  # fmt: skip
            else:
                log.debug("%s: planner unreachable for %.1f s (%s)", what, now - down_since, exc)
            sleep(min(policy.outage_retry_s, policy.planner_outage_s - (now - down_since)))
        else:
            return answer


class LeaseRenewer:
    """Renews a lease at a third of its remaining time until stopped, so a pull longer than the planner's
    lease TTL keeps its slot and its report is accepted. A failed renewal is logged, never raised: the
    pull goes on, and at worst its report is refused (409, logged)."""

    def __init__(self, client: PlannerClient, assignment: Assignment) -> None:
        self._client = client
        self._id = assignment.id
        self._expires_at = assignment.expires_at_unix
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rfork-renew-{self._id[:8]}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(max(0.05, (self._expires_at - time.time()) / 3)):
            try:
                self._expires_at = self._client.renew_assignment(self._id).expires_at_unix
            except Exception as exc:  # noqa: BLE001 - a lost renewal must not fail the pull
                log.warning("could not renew assignment %s: %s", self._id, exc)
                return

    def stop(self) -> None:
        """Stop renewing (before the report ends the lease)."""
        self._stop.set()


@dataclass(kw_only=True)
class Source:
    """One leased candidate for one rank; say how the pull went with `succeeded` or `failed`."""

    session: PlannerSession
    assignment: Assignment
    rank: int
    name: str  # "rfork-tcp", "rfork-shm", ..., or "nccl"
    outcome: bool | None = None
    renewer: LeaseRenewer | None = None  # keeps the lease while the pull runs

    @property
    def candidate(self) -> Candidate:
        """The leased seed."""
        return self.assignment.candidates[0]

    @property
    def instance_id(self) -> str:
        """The leased seed's planner id."""
        return self.candidate.instance_id

    def attempt(
        self,
        seconds: float,
        *,
        nbytes: int = 0,
        error: BaseException | None = None,
        phases: dict[str, float] | None = None,
    ) -> Attempt:
        """How this source served the rank (failed when `error` is given), as a LoadResult lists it."""
        return Attempt(
            source=self.name,
            instance_id=self.instance_id,
            rank=self.rank,
            ok=error is None,
            bytes=nbytes,
            seconds=seconds,
            error=None if error is None else str(error),
            phases=phases if phases is not None else {},
        )

    def manifest(self) -> RankManifest:
        """The seed's manifest for this rank, checked (the one check: everything after trusts it) and
        matching the identity's anchor.

        PullError (malformed, another rank) or ChecksumMismatch (not the anchored digest set).
        """
        cand = self.candidate
        manifest = cand.rank_manifest()
        try:
            check_manifest(manifest)
        except ManifestError as exc:
            raise PullError(f"seed {cand.instance_id}: bad manifest: {exc}") from exc
        if manifest.rank != self.rank:
            raise PullError(
                f"seed {cand.instance_id}: manifest is for rank {manifest.rank}, wanted {self.rank}"
            )
        check_anchor(cand.instance_id, cand.anchor, manifest)
        return manifest

    def succeeded(self, nbytes: int, seconds: float) -> None:
        """Report the pull (ends the lease); the session asks no more for this rank."""
        self.outcome = True
        if self.renewer is not None:
            self.renewer.stop()
        self.session.report(self, ok=True, nbytes=nbytes, seconds=seconds, error=None)

    def failed(self, error: BaseException, seconds: float) -> None:
        """Report the failure (counts against the seed); the session asks again without this seed."""
        self.outcome = False
        if self.renewer is not None:
            self.renewer.stop()
        self.session.report(self, ok=False, nbytes=0, seconds=seconds, error=error)

    def aborted(self, error: BaseException, seconds: float) -> None:
        """Report that this loader stopped the pull (a signal): the lease ends now, so the seed's slot is
        free at once, and the reason `aborted` is never held against the seed."""
        self.outcome = False
        if self.renewer is not None:
            self.renewer.stop()
        self.session.report(self, ok=False, nbytes=0, seconds=seconds, error=error, reason="aborted")


def check_anchor(seed_id: str, anchor: Anchor | None, manifest: RankManifest) -> None:
    """ChecksumMismatch unless `manifest`'s digest set is the anchored one for its algorithm."""
    if anchor is None:
        raise ChecksumMismatch(f"seed {seed_id}: the planner sent no anchored digest set; not trusting it")
    if anchor.checksum_algorithm != manifest.checksum_algorithm:
        raise ChecksumMismatch(
            f"seed {seed_id}: manifest algorithm {manifest.checksum_algorithm!r} is not the anchored "
            f"{anchor.checksum_algorithm!r}"
        )
    got = digest_set(manifest.checksum_algorithm, [t.model_dump() for t in manifest.tensors])
    if got != anchor.digest_set:
        raise ChecksumMismatch(
            f"seed {seed_id}: manifest digest set {got[:16]} differs from the identity's anchored "
            f"{anchor.digest_set[:16]} (anchored by {anchor.instance_id})"
        )


def check_manifest(manifest: RankManifest) -> None:
    """ManifestError naming the first tensor or region that does not add up (`RankManifest.check`,
    which also decodes the descriptors the reads use)."""
    try:
        manifest.check()
    except ValueError as exc:
        raise ManifestError(str(exc)) from exc


class PlannerSession:
    """Assignments and reports for one Loader; `seconds` sums the time spent waiting on the planner."""

    def __init__(
        self,
        *,
        planner_url: str | None,
        token: str | None,
        identity: SourceIdentity,
        options: LoadOptions,
        fallback_bytes: int | None,
    ) -> None:
        self.planner_url = planner_url
        self.identity = identity
        self.options = options
        self.seconds = 0.0
        self._token = token
        self._fallback_bytes = fallback_bytes  # one rank's checkpoint bytes, when there is a checkpoint
        self._client: PlannerClient | None = None
        self._pulled: list[str] = []  # assignments that succeeded: linked to the seed this loader becomes
        # when this loader first asked for each rank: a loader whose pull failed asks again saying it has
        # waited since then, so it keeps its place in the planner's line instead of queueing behind
        # everyone who started with it (a cut seed's loader lost a whole generation on the emulated fleet)
        self._first_ask: dict[int, float] = {}
        # why the last `sources(rank)` ended without a pull that worked: (kind, one line); kind is the
        # fallback's metric label (rfork.metrics.FALLBACKS)
        self.miss: tuple[str, str] | None = None
        self._shares_client = False

    def about(
        self, identity: SourceIdentity, options: LoadOptions, *, fallback_bytes: int | None = None
    ) -> PlannerSession:
        """A session for another identity (seeds that hold part of what this one loads) over this one's
        planner client: no second connection or TLS context; closing it leaves the client open."""
        other = PlannerSession(
            planner_url=self.planner_url,
            token=self._token,
            identity=identity,
            options=options,
            fallback_bytes=fallback_bytes,
        )
        other._client, other._shares_client = self.client, True
        return other

    @property
    def client(self) -> PlannerClient | None:
        """The planner client (created on first use; None without a planner)."""
        if self._client is None and self.planner_url is not None:
            t0 = time.perf_counter()
            self._client = PlannerClient(self.planner_url, token=self._token)
            self.seconds += time.perf_counter() - t0
        return self._client

    def sources(self, rank: int) -> Iterator[Source]:
        """Sources for `rank` until one succeeds, the attempts run out or no seed is left; when the
        sequence ends without a success, `miss` says why. A setting the planner refuses (token, wire
        protocol, URL) raises ConfigurationError instead: no fallback can fix it."""
        self.miss = ("no_planner", "no planner URL given")
        client = self.client
        if client is None:
            return
        one_sided = self.options.one_sided
        excluded = list(self.options.exclude)
        failures: list[str] = []
        for _ in range(self.options.max_attempts):
            self.miss = None
            assignment = self._ask(rank, excluded, one_sided) if one_sided else None
            unreachable = self.miss is not None and self.miss[0] == "planner_unreachable"
            if assignment is None and self.options.nccl and not unreachable:
                assignment = self._ask(rank, excluded, [*one_sided, "nccl"])
            if assignment is None:
                if failures and self.miss is not None and self.miss[0] == "no_seed":
                    self.miss = ("pulls_failed", f"every seed tried failed ({'; '.join(failures)})")
                return
            cand = assignment.candidates[0]
            if cand.provider in one_sided or "nccl" not in (cand.backends or ()):
                name = f"rfork-{cand.provider}"
            else:
                name = "nccl"
            renewer = LeaseRenewer(client, assignment)
            source = Source(session=self, assignment=assignment, rank=rank, name=name, renewer=renewer)
            try:
                yield source
            finally:
                renewer.stop()
            if source.outcome:
                return
            failures.append(f"{cand.instance_id[:8]} over {name}")
            excluded.append(cand.instance_id)
        self.miss = (
            "pulls_failed",
            f"{len(failures)} pull(s) failed ({'; '.join(failures)}), no attempt left",
        )

    def report(
        self,
        source: Source,
        *,
        ok: bool,
        nbytes: int,
        seconds: float,
        error: BaseException | None,
        reason: str | None = None,
    ) -> None:
        """End the lease with the pull's outcome; a lost report never fails the load. `reason`
        overrides the one read from `error` (`aborted`)."""
        if ok:
            self._pulled.append(source.assignment.id)
        elif reason is None:
            reason = None if error is None else fault_reason(error)
        t0 = time.perf_counter()
        try:
            assert self.client is not None
            self.client.report_transfer(
                source.assignment.id,
                outcome="success" if ok else "failure",
                bytes=nbytes,
                seconds=seconds,
                backend=source.name.removeprefix("rfork-"),
                reason=reason,
                error=None if error is None else str(error)[:2000],
            )
        except Exception as exc:  # noqa: BLE001 - the data is here; a lost report must not fail the load
            log.warning("could not report transfer %s: %s", source.assignment.id, exc)
        finally:
            self.seconds += time.perf_counter() - t0

    def report_seeded(self, instance_ids: list[str]) -> None:
        """Tell the planner which instance now serves what the successful pulls read (the fleet page's
        tree chains through it); only for a single publication, and a lost report never fails the load."""
        if len(instance_ids) != 1 or self.client is None:
            return
        for assignment_id in self._pulled:
            try:
                self.client.report_seeded(assignment_id, instance_ids[0])
            except Exception as exc:  # noqa: BLE001 - the fleet page's link only; the load has succeeded
                log.warning("could not link assignment %s to seed %s: %s", assignment_id, instance_ids, exc)
        self._pulled.clear()

    def close(self) -> None:
        """Close the client's connections (not a client it shares: `about`)."""
        if self._client is not None and not self._shares_client:
            self._client.close()
            self._client = None

    def _ask(self, rank: int, excluded: list[str], backends: list[str]) -> Assignment | None:
        """One assignment (waiting out 429s as the planner advises), or None: no seed, or fall back now."""
        client = self.client
        assert client is not None
        options = self.options
        per_rank = (
            None if self._fallback_bytes is None else self._fallback_bytes // max(self.identity.world_size, 1)
        )

        busy: list[AllBusy] = []  # the last 429, while the latest answer was one
        not_anchored: list[NoSource] = []  # the last 404 said the rank has no anchor at all

        def ask(waited_s: float) -> Assignment | None:
            try:
                found = client.request_assignment(
                    identity=self.identity,
                    rank=rank,
                    labels=dict(options.labels or default_labels()),
                    providers=options.one_sided,
                    backends=backends,
                    requester_id=None,
                    exclude=excluded,
                    fallback_s=None
                    if per_rank is None
                    else fallback_seconds(per_rank, options.fallback_gbps),
                    serves_after=options.max_concurrent_pulls if options.become_seed else 0,
                    waited_s=waited_s,
                    raise_no_source=True,
                )
            except NoSource as exc:
                if not exc.anchored:
                    not_anchored[:] = [exc]
                return None
            except AllBusy as exc:
                busy[:] = [exc]
                raise
            busy.clear()
            return found

        t0 = time.perf_counter()
        since = self._first_ask.setdefault(rank, time.monotonic())
        try:
            found = ask_with_wait(
                ask,
                policy=options.busy_wait,
                busy_type=AllBusy,
                what=f"rank {rank}",
                outage_type=PlannerUnavailable,
                since=since,
            )
        except (AuthError, ProtocolMismatch, BadRequest, NotFound) as exc:
            raise refused_setting(exc, self.planner_url) from exc
        except Exception as exc:  # noqa: BLE001 - an outage falls back (the caller says so, once)
            self.miss = ("planner_unreachable", f"planner unreachable or failing: {exc}")
            return None
        finally:
            self.seconds += time.perf_counter() - t0
        if found is None:
            if busy:
                why = (
                    "the planner says reading the checkpoint is sooner than waiting"
                    if busy[0].fallback
                    else f"waited the limit of {options.busy_wait.max_wait_s:.0f} s"
                )
                self.miss = ("all_busy", f"every seed of the identity is busy ({why})")
            elif not_anchored:
                self.miss = (
                    "not_anchored",
                    f"{self.identity.model} (identity {self.identity.key()[:12]}) rank {rank} is not "
                    "anchored: no admin or anchor-role seed has set its digests, so the planner serves none "
                    "of its instances",
                )
            else:
                self.miss = (
                    "no_seed",
                    f"no READY seed of {self.identity.model} (identity {self.identity.key()[:12]}) "
                    f"shares a transport with this loader ({', '.join(backends)})",
                )
            return None
        cand = found.candidates[0]
        log.info(
            "rank %d: pulling from seed %s over %s: %s",
            rank,
            cand.instance_id,
            cand.provider,
            cand.reason.summary
            if cand.reason is not None
            else "the planner gave no reason (an older planner)",
        )
        for other in found.candidates[1:]:
            log.debug(
                "rank %d: alternative %s: %s",
                rank,
                other.instance_id,
                other.reason.summary if other.reason else "?",
            )
        return found


def refused_setting(exc: Exception, planner_url: str | None) -> ConfigurationError:
    """The ConfigurationError for a planner answer that no retry can change: a refused token (401/403),
    another wire protocol, a request the planner calls malformed, or a URL that is not the planner's."""
    if isinstance(exc, AuthError):
        return ConfigurationError(f"the planner refused the token: {exc}", setting="token")
    if isinstance(exc, ProtocolMismatch):
        return ConfigurationError(f"wire protocol: {exc}", setting="protocol")
    if isinstance(exc, NotFound):
        return ConfigurationError(
            f"{planner_url} is not a planner's base URL (it answered {exc})", setting="planner_url"
        )
    return ConfigurationError(f"the planner refused the request: {exc}", setting="request")


def fault_reason(error: BaseException) -> str:
    """The report's reason: `checksum_mismatch` and `transport` count against the seed at the planner;
    anything else (this loader's destination, engine, algorithm, a bad manifest) is the error's class
    name, recorded but never blamed on the seed."""
    seen: set[int] = set()
    cur: BaseException | None = error
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ChecksumMismatch):
            return "checksum_mismatch"
        if isinstance(cur, BackendUnavailable):
            break  # this loader could not open its engine: not the seed's fault
        if isinstance(cur, (TransferError, TimeoutError, ConnectionError)):
            return "transport"
        cur = cur.__cause__ or cur.__context__
    return type(error).__name__
