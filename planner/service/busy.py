"""The 429: answering an assignment that finds every seed busy, and when to ask again (planner.burst).

A repeated 429 of the same request shape is answered from memory while nothing changed; its estimate
reads the live leases and recent pulls in a transaction of its own, after the write.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import Connection, select

from planner.burst import BusyEstimate, estimate_busy, pull_rate_bps
from planner.contract import wire
from planner.contract.errors import AllBusy
from planner.models import Instance, Lease, Manifest
from planner.service.base import ServiceState

# A loader that reported its pull and will serve publishes its seed a moment later (verify tail,
# register, manifest, READY: 0.1-0.3 s on the emulated fleet). Until then its freed slot and its own
# are "due now" for the 429's estimate; after this long without a seed on its node, not any more.
SEED_APPEARS_S = 5.0
SERVING_MEMORY = 100_000  # leases remembered as "will serve" (oldest forgotten first)

# every 429 with what its estimate was computed from (DEBUG: off unless asked, e.g. by the fleet harness)
decisions = logging.getLogger("planner.decisions")


class BusyOps(ServiceState):
    """Planner's busy answers: the last 429 per request shape and its estimate's reads, kept while
    nothing changed (set by Planner.__init__)."""

    _busy: dict[tuple[Any, ...], tuple[int, float, str]]
    _busy_reads: dict[tuple[str, int], tuple[int, float, list[float], float, int]]
    _rank_bytes_cache: dict[tuple[str, int], int]
    # lease id -> requester (node, rack) when its loader will serve, None when it will not: every lease
    # this planner process granted (a lease it does not know was granted before a restart)
    _serving: dict[str, tuple[str, str] | None]

    def _note_lease(self, lease_id: str, node: str, rack: str, serves: bool) -> None:
        """Remember a lease granted here and whether its loader (on `node` in `rack`) will serve."""
        if len(self._serving) >= SERVING_MEMORY:
            self._serving.pop(next(iter(self._serving)))
        self._serving[lease_id] = (node, rack) if serves else None

    def _inbound_copies(self, s: Any, key: str, rank: int, rack: str, now: float) -> list[str]:
        """The seeds serving live pulls of loaders in `rack` that will serve there: the rack's copies
        on their way (rack_first_copies)."""
        if not self._serving:
            return []
        live = s.execute(
            select(Lease.id, Lease.instance_id).where(
                Lease.identity_key == key,
                Lease.rank == rank,
                Lease.ended_at.is_(None),
                Lease.expires_at > now,
            )
        ).all()
        return [str(seed) for lease_id, seed in live if (self._serving.get(lease_id) or ("", ""))[1] == rack]

    def _seeds_appearing(self, s: Any, key: str, rank: int, now: float) -> int:
        """Loaders that reported a successful pull in the last SEED_APPEARS_S, will serve, and have not
        yet published a READY seed on their node: seeds about to appear (the 429 counts them due now, or
        a waiter would sleep a whole pull while one of them became free: measured on the emulated fleet).

        A lease granted before this process started (a restart: the memory is gone) is taken as one
        that will serve, less the READY instances registered since it ended: after a restart on the
        emulated fleet a waiter was told a whole pull while a seed appeared, and lost a generation.
        """
        ended = s.execute(
            select(Lease.id, Lease.ended_at).where(
                Lease.identity_key == key,
                Lease.rank == rank,
                Lease.outcome == "success",
                Lease.ended_at > now - SEED_APPEARS_S,
            )
        ).all()
        if not ended:
            return 0
        nodes: dict[str, float] = {}
        unknown: list[float] = []
        for lease_id, ended_at in ended:
            if lease_id not in self._serving:
                unknown.append(ended_at)
            elif (who := self._serving[lease_id]) is not None:
                nodes[who[0]] = ended_at
        if not nodes and not unknown:
            return 0
        published = s.execute(
            select(Instance.node, Instance.created_at).where(
                Instance.identity_key == key,
                Instance.status == "READY",
                Instance.created_at >= min([*nodes.values(), *unknown]) - 1.0,
            )
        ).all()
        done = {node for node, created in published if node in nodes and created >= nodes[node] - 1.0}
        known = sum(1 for node in nodes if node not in done)
        if not unknown:
            return known
        since_unknown = sum(1 for _, created in published if created >= min(unknown) - 1.0)
        return known + max(0, len(unknown) - since_unknown)

    def _still_busy(
        self, last: tuple[int, float, str] | None, changes: int, now: float, s: Connection
    ) -> str | None:
        """The busy seed of the last 429 of this request's shape if it still holds: no write of this
        process changed rows since (nor this transaction, in a batch) and the clock moved less than
        `busy_cache_s`. A fleet started at once comes back as a herd whenever leases run late (they are
        due "now"): at 10,000 instances, thousands of 429s per 50 ms, each reading every seed of the
        identity. Only a 429 is answered this way, never a lease: a stale answer costs one more ask
        (another process's writes are seen after at most `busy_cache_s`)."""
        if last is None or not self._unchanged_since(last[0], last[1], changes, now):
            return None
        return last[2] if self.db.unchanged(s) else None

    def _unchanged_since(self, then_changes: int, then: float, changes: int, now: float) -> bool:
        """No write of this process changed rows since `then` and the clock moved less than
        `busy_cache_s` (the rule for reusing a 429 and its estimate's reads)."""
        return then_changes == changes and 0 <= now - then <= self.settings.busy_cache_s

    def _all_busy(
        self, key: str, body: wire.AssignmentRequest, busy_seed: str, now: float
    ) -> wire.Assignment:
        """Raise the 429 (AllBusy) with its estimate; `busy_seed`: one of the busy seeds."""
        est = self._busy_estimate(key, body, busy_seed, now)
        raise AllBusy(
            f"all sources for rank {body.rank} are at their pull limit; "
            f"a slot is expected in {est.retry_after_s:.2f} s",
            retry_after_s=est.retry_after_s,
            expected_pull_s=est.expected_pull_s,
            fallback=est.fallback,
        )

    def _busy_estimate(
        self, key: str, body: wire.AssignmentRequest, seed_id: str, now: float
    ) -> BusyEstimate:
        """planner.burst's estimate from the live leases on the identity's seeds and its recent pulls.

        Its own read transaction: the live leases' starts (one column) and the rate of the last
        `rate_window` successful pulls that ended within `rate_history_s`; reused while unchanged (as
        `_still_busy`). `seed_id`: a busy seed, for the rank's bytes.
        """
        st, sql = self.settings, self._sql
        params = {
            "b_key": key,
            "b_rank": body.rank,
            "b_oldest": now - st.rate_history_s,
            "b_window": st.rate_window,
            "b_now": now,
            "b_oldest_beat": now - st.heartbeat_ttl_s,
        }
        room = (key, body.rank)
        since = now - body.waited_s
        tie = waiter_tie(body)
        changes = self.db.changes
        reads = self._busy_reads.get(room)
        if reads is None or not self._unchanged_since(reads[0], reads[1], changes, now):
            with self.db.read() as session:
                s = session.connection()
                recent = s.execute(sql.recent_pulls, params).all()
                if not recent:  # a new identity: what pulls of any identity achieved here
                    recent = s.execute(sql.recent_pulls_any, params).all()
                rank_bytes = self._rank_bytes(s, key, body.rank, seed_id)
                rate = pull_rate_bps(((r[0], r[1]) for r in recent), default_bps=st.assumed_pull_gbps * 1e9)
                starts = [r[0] for r in sql.live_starts.cursor(s, params).fetchall()]
                # a seed about to appear ends like a lease due now (ends are max(start + pull, now))
                starts = [now - 1e6] * self._seeds_appearing(s, key, body.rank, now) + starts
            if len(self._busy_reads) > 4096:
                self._busy_reads.clear()
            reads = self._busy_reads[room] = (changes, now, starts, rate, rank_bytes)
        _, _, starts, rate, rank_bytes = reads
        position = self.waiting.position(room, now, since, tie)
        est = estimate_busy(
            lease_starts=starts,
            rank_bytes=rank_bytes,
            rate_bps=rate,
            now=now,
            position=position,
            # a solo requester's new seeds serve one pull at a time (solo_pulls_for_seeds)
            serves_after=min(body.serves_after, 1) if st.solo_pulls_for_seeds else body.serves_after,
            fallback_s=body.fallback_s,
            min_s=st.retry_after_min_s,
            max_s=st.retry_after_max_s,
        )
        if decisions.isEnabledFor(logging.DEBUG):
            decisions.debug(
                "busy node=%s rank=%d waited=%.2f position=%d leases=%d starts_ago=%s rate_MBps=%.1f "
                "pull_s=%.2f retry_after=%.2f fallback=%s",
                body.labels.node,
                body.rank,
                body.waited_s,
                position,
                len(starts),
                [round(now - x, 2) for x in starts[:8]],
                rate / 1e6,
                est.expected_pull_s,
                est.retry_after_s,
                est.fallback,
            )
        if not est.fallback:
            self.waiting.promise(room, now + est.retry_after_s, since, now=now, tie=tie)
        return est

    def _rank_bytes(self, s: Any, key: str, rank: int, instance_id: str) -> int:
        """Bytes of one rank of an identity (from a seed's manifest; fixed by the identity, so cached)."""
        cached = self._rank_bytes_cache.get((key, rank))
        if cached is not None:
            return cached
        raw = s.execute(
            select(Manifest.body).where(Manifest.instance_id == instance_id, Manifest.rank == rank)
        ).scalar()
        nbytes = wire.RankManifest.model_validate_json(raw).region_bytes if raw else 0
        if len(self._rank_bytes_cache) > 4096:
            self._rank_bytes_cache.clear()
        self._rank_bytes_cache[(key, rank)] = nbytes
        return nbytes


def waiter_tie(body: wire.AssignmentRequest) -> str:
    """Orders waiters that started at the same instant (planner.burst.WaitingRoom): the requester."""
    return body.requester_id or body.labels.node
