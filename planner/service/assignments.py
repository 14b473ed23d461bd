"""Assignments: lease the best free seed for one rank (routes/assignments.py, planner.hotpath).

The hot path: Core statements (planner.queries) in the caller's transaction, the policy
(planner.selection) ranking the free seeds the query returns, and the answer encoded after the write.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import functools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import Connection, select

from planner.contract import control_token, wire
from planner.contract.errors import NoSource
from planner.models import Anchor, Instance
from planner.selection import RankReason, Requester, SeedView, choose_provider, rank_reason, tier_key
from planner.service.base import now_or_clock
from planner.service.busy import BusyOps, decisions, waiter_tie
from planner.service.reports import identified, reporter_key, standing_claims, witness_key

ACCUSED_CHECK_S = 1.0


class AssignmentOps(BusyOps):
    """Planner's assignments (and, through BusyOps, its 429s)."""

    def assign(
        self,
        body: wire.AssignmentRequest,
        now: float | None,
        holder: str | None = None,
        credential: str | None = None,
    ) -> wire.Assignment:
        """Lease the best free seed for one rank; the candidates carry their manifests as stored text.

        Raises NoSource (404) or AllBusy (429). Atomic across planner processes: the candidate seeds'
        rows are locked (PostgreSQL) or the whole write is serialised (SQLite) while leases are counted.
        `now` None (the routes): the clock is read once the write lock is held, so recorded lease times
        follow the order of the decisions (see `now_or_clock`). `credential`: the witness behind the
        holder (Principal.witness; None: the holder itself), recorded with the lease for its reports.
        """
        with self.db.write_core() as s:  # Core on the hot path: no ORM session or unit of work
            answer = self.assign_in(s, body, now, holder, credential)
        return answer()

    def assign_in(
        self,
        s: Connection,
        body: wire.AssignmentRequest,
        now: float | None,
        holder: str | None,
        credential: str | None = None,
    ) -> Callable[[], wire.Assignment]:
        """Planner.assign's write in the caller's transaction `s`; what it returns gives the answer (or
        raises NoSource or AllBusy) once `s` has committed: the 429's estimate reads in a transaction of
        its own, and the answer's encoding need not hold the write lock. Raises nothing itself but the
        database's errors (so a batch, Planner.write_batch, never has to undo one assignment's writes)."""
        key = body.identity.key()
        excluded = set(body.exclude)
        if body.requester_id:
            excluded.add(body.requester_id)
        st, sql = self.settings, self._sql
        clock = now is None
        now = now_or_clock(now)
        params: dict[str, Any] = {
            "b_key": key,
            "b_rank": body.rank,
            "b_oldest_beat": now - st.heartbeat_ttl_s,
            "b_now": now,
        }
        if excluded:
            params["b_excluded"] = sorted(excluded)
        hold = st.rack_hold and bool(body.labels.rack)
        solo = solo_pulls(st.solo_pulls_for_seeds, body)
        shape: tuple[Any, ...] = (
            key,
            body.rank,
            frozenset(excluded),
            tuple(body.providers),
            tuple(body.backends),
            solo,
        )
        if hold:
            shape += (body.labels.rack,)
        changes = self.db.changes
        busy_seed = self._still_busy(self._busy.get(shape), changes, now, s)
        if busy_seed is not None:
            return functools.partial(self._all_busy, key, body, busy_seed, now)
        req = Requester(
            node=body.labels.node,
            rack=body.labels.rack,
            zone=body.labels.zone,
            key=body.requester_id or body.labels.node,
        )
        ranked: Sequence[SeedView] = ()
        by_id: dict[str, tuple[Any, str]] = {}
        # rack_hold: the rack's seeds all busy -> wait for them (no read of the other racks' seeds)
        held = self._rack_busy(s, body, params, req.rack, solo) if hold else None
        attempts = 0 if held else 3  # PostgreSQL: again if the chosen filled up before their locks
        for _attempt in range(attempts):
            free, busy_seed = self._free_seeds(s, req, body, params, bool(excluded), solo)
            by_id = {r.id: (r, p) for r, p in free}
            ranked = self.policy.rank(req, [_seed_view(r, solo) for r, _ in free])[: st.max_candidates]
            if not ranked or self.db.sqlite:  # SQLite: the write lock was held while they were counted
                break
            # PostgreSQL: lock the chosen rows (id order), then count their live leases again
            ids = [v.instance_id for v in ranked]
            locked = {r.id for r in sql.lock_chosen.rows(s, {**params, "b_ids": ids})}
            if clock:  # again, now that the row locks are held
                now = params["b_now"] = now_or_clock(None)
            live = sql.live_leases.rows(s, {"b_ids": ids, "b_rank": body.rank, "b_now": now})
            counts = Counter(r.instance_id for r in live)
            ranked = self.policy.rank(
                req,
                [replace(v, active_leases=counts[v.instance_id]) for v in ranked if v.instance_id in locked],
            )
            if ranked:
                break
            busy_seed = busy_seed or next(iter(by_id))
        probation = self._probation(s, body, params, holder)
        if probation is not None:  # leased first: an independent loader verifies the accused seed
            by_id[probation[0].id] = probation
            others = [v for v in ranked if v.instance_id != probation[0].id]
            ranked = [_seed_view(probation[0], solo), *others][: st.max_candidates]
        if held:
            busy_seed = held
        if not ranked:  # the 429's arithmetic runs after the write: heartbeats and other writes go on
            if busy_seed is None:
                return _raising(self._no_source(s, key, body.rank))
            if len(self._busy) > 4096:
                self._busy.clear()
            self._busy[shape] = (changes, now, busy_seed)
            return functools.partial(self._all_busy, key, body, busy_seed, now)
        lease_id = uuid.uuid4().hex
        expires_at = now + st.lease_ttl_s
        sql.insert_lease.run(
            s,
            {
                "id": lease_id,
                "instance_id": ranked[0].instance_id,
                "rank": body.rank,
                "identity_key": key,
                "requester_id": body.requester_id,
                "holder": holder,
                "credential": credential or holder,
                "provider": by_id[ranked[0].instance_id][1],
                "created_at": now,
                "expires_at": expires_at,
            },
        )
        self._note_lease(lease_id, body.labels.node, body.labels.rack, body.serves_after > 0)
        reasons = {v.instance_id: rank_reason(self.policy.name, req, v, rack_hold=hold) for v in ranked}
        chosen = list(reasons)
        if decisions.isEnabledFor(logging.DEBUG):
            decisions.debug(
                "lease node=%s rank=%d waited=%.2f seed=%s (node %s, %d active) of %d free",
                body.labels.node,
                body.rank,
                body.waited_s,
                chosen[0],
                ranked[0].node,
                ranked[0].active_leases,
                len(ranked),
            )
        details = {d.id: d for d in sql.chosen_details.rows(s, {"b_ids": chosen, "b_rank": body.rank})}
        return functools.partial(
            self._assignment, key, now, body, reasons, by_id, details, lease_id, expires_at
        )

    @staticmethod
    def _no_source(s: Connection, key: str, rank: int) -> NoSource:
        """The 404 for a rank with no free seed; it says so when the identity's rank has no anchor at all
        (then no instance of it is served, however many are READY: an authority must anchor it first)."""
        row = select(Anchor.rank).where(Anchor.identity_key == key, Anchor.rank == rank).limit(1)
        anchored = s.execute(row).first() is not None
        if anchored:
            return NoSource(f"no READY source for identity {key[:12]} rank {rank}")
        return NoSource(
            f"identity {key[:12]} rank {rank} is not anchored: no admin or anchor-role seed has set its "
            "digests, so none of its instances is served",
            anchored=False,
        )

    def _probation(
        self, s: Connection, body: wire.AssignmentRequest, params: dict[str, Any], holder: str | None
    ) -> tuple[Any, str] | None:
        """An accused seed that re-hashed clean, has no live pull and was not accused by this requester
        (nor by checksum_witnesses distinct reporters), with the transport for it; None (as a rule).

        Leasing it first is how the planner schedules the independent verification a checksum report
        needs (planner.service.reports): the loader verifies every byte as always, and a failed pull
        costs it one attempt before the next candidate."""
        if not self._any_accused(s):
            return None
        rows = self._sql.accused.rows(s, {**params, "b_excluded": params.get("b_excluded", []), "b_limit": 8})
        me = reporter_key(holder, body.requester_id)
        for r in rows:
            provider = choose_provider(body.providers, body.backends, r.backends, same_node(body, r))
            if provider is None:
                continue
            since = s.execute(select(Instance.accused_since).where(Instance.id == r.id)).scalar()
            claims = standing_claims(s, r.id, since or 0.0)
            if identified(me) and me in {reporter_key(c.holder, c.requester_id) for c in claims}:
                continue
            if len({witness_key(c.holder, c.credential) for c in claims}) >= self.settings.checksum_witnesses:
                continue  # corroborated by distinct credentials: no probation until the accusation lapses
            if not self.db.sqlite:  # lock it before counting its live pulls (the one lock order)
                self._sql.lock_seed.run(s, {"b_seed": r.id})
            if self._sql.live_leases.rows(
                s, {"b_ids": [r.id], "b_rank": body.rank, "b_now": params["b_now"]}
            ):
                continue  # one probation pull at a time
            return r, provider
        return None

    def _any_accused(self, s: Connection) -> bool:
        """Whether any seed is accused, read at most every ACCUSED_CHECK_S (this process's own
        accusations at once): the probation query then costs a fleet with no accusation nothing. Another
        process's accusation is seen within ACCUSED_CHECK_S; its seed waits that long for probation."""
        clock = time.monotonic()
        if self.accused_seen or clock - self.accused_checked_at >= ACCUSED_CHECK_S:
            found = s.execute(select(Instance.id).where(Instance.accused_since.is_not(None)).limit(1)).first()
            self.accused_seen = found is not None
            self.accused_checked_at = clock
        return self.accused_seen

    def _rack_busy(
        self, s: Connection, body: wire.AssignmentRequest, params: dict[str, Any], rack: str, solo: bool
    ) -> str | None:
        """rack_hold: a busy seed to wait for when the rack has seeds that could serve this requester and
        none is free, or when it has none yet but `rack_first_copies` of its loaders are already pulling
        their copies into it; None when one is free, or the rack may take another first copy."""
        rows = self._sql.in_rack.rows(
            s, {**params, "b_excluded": params.get("b_excluded", []), "b_req_rack": rack, "b_limit": 16}
        )
        usable = [
            r for r in rows if choose_provider(body.providers, body.backends, r.backends, same_node(body, r))
        ]
        if usable:
            if any(r.active < pull_limit(r.max_concurrent_pulls, solo) for r in usable):
                return None
            return str(usable[0].id)
        inbound = self._inbound_copies(s, body.identity.key(), body.rank, rack, params["b_now"])
        return inbound[0] if len(inbound) >= self.settings.rack_first_copies else None

    def _assignment(
        self,
        key: str,
        now: float,
        body: wire.AssignmentRequest,
        reasons: dict[str, RankReason],
        by_id: dict[str, Any],
        details: dict[str, Any],
        lease_id: str,
        expires_at: float,
    ) -> wire.Assignment:
        """The 201's body: the chosen candidates in their order, each with its reason, a control token
        for the first."""
        chosen = list(reasons)
        candidates = []
        for iid in chosen:
            r, provider = by_id[iid]
            d = details[iid]
            token = (
                control_token.issue_control_token(
                    control_token.unseal(self._control_secret, iid, d.control_key),
                    lease_id=lease_id,
                    instance_id=iid,
                    rank=body.rank,
                    expires_at=expires_at,
                )
                if iid == chosen[0] and d.control_key
                else None
            )
            candidates.append(
                wire.Candidate(
                    instance_id=iid,
                    rank=body.rank,
                    provider=provider,
                    address=base64.b64encode(d.address).decode(),
                    backends=r.backends,
                    control_url=d.control_url,
                    labels=wire.Labels(node=r.node, rack=r.rack, zone=r.zone),
                    anchor=wire.Anchor(
                        checksum_algorithm=r.checksum_algorithm,
                        digest_set=r.digest_set,
                        instance_id=r.anchored_by,
                    ),
                    control_token=token,
                    reason=wire.CandidateReason(**dataclasses.asdict(reasons[iid])),
                    manifest=wire.StoredManifest(d.body),  # as stored: never parsed here
                )
            )
        if body.waited_s > 0:  # it waited: its place in line is free for the others
            self.waiting.leave((key, body.rank), now - body.waited_s, waiter_tie(body))
        return wire.Assignment(
            id=lease_id,
            expires_at=dt.datetime.fromtimestamp(expires_at, tz=dt.timezone.utc).isoformat(),
            expires_at_unix=expires_at,
            candidates=candidates,
        )

    def _free_seeds(
        self,
        s: Connection,
        req: Requester,
        body: wire.AssignmentRequest,
        params: dict[str, Any],
        excluded: bool,
        solo: bool,
    ) -> tuple[Sequence[tuple[Any, str]], str | None]:
        """The free seeds the policy must see, each with the transport for this requester, and a busy
        seed it could use (None if none, or if the free ones were not all read).

        The query returns free seeds first (a tiered policy's: in `tier_key` order), at most b_limit
        rows; the limit grows until the rows read hold every free seed, or, for a tiered policy, the
        whole tier of the `max_candidates`-th: what a decision reads grows with the free seeds near the
        requester, not with the fleet. `solo`: a seed with a live pull is busy for this requester
        (`solo_pulls`); the query's order knows only the seeds' own limits, so such seeds are skipped,
        not taken as the end of the free ones.
        """
        sql, k = self._sql, self.settings.max_candidates
        tiered = self.policy.tiered
        if tiered:
            stmt = sql.ranked_excluding if excluded else sql.ranked
            params = {**params, "b_node": req.node, "b_rack": req.rack, "b_zone": req.zone}
        else:
            stmt = sql.candidates_excluding if excluded else sql.candidates
        limit = max(16, 4 * k)
        while True:
            found = stmt.rows(s, {**params, "b_limit": limit})
            free: list[tuple[Any, str]] = []
            busy_seed, every_free = None, len(found) < limit
            for r in found:
                provider = choose_provider(body.providers, body.backends, r.backends, same_node(body, r))
                if r.active >= r.max_concurrent_pulls:
                    every_free = True  # free seeds sort first
                    if provider is not None:
                        busy_seed = r.id
                        break
                elif provider is None:
                    continue
                elif solo and r.active >= 1:
                    busy_seed = busy_seed or r.id
                else:
                    free.append((r, provider))
            if every_free and (free or busy_seed is not None or len(found) < limit):
                return free, busy_seed
            # rows past the k-th free seed's tier cannot change the policy's first k
            if (
                tiered
                and len(free) >= k
                and tier_key(req, _seed_view(found[-1], solo))
                > tier_key(req, _seed_view(free[k - 1][0], solo))
            ):
                return free, None
            limit *= 4


def _raising(exc: Exception) -> Callable[[], Any]:
    """A continuation that raises `exc` (a refusal decided inside the write, raised after it)."""

    def answer() -> Any:
        raise exc

    return answer


def solo_pulls(setting: bool, body: wire.AssignmentRequest) -> bool:
    """Whether this requester is leased only seeds with no live pull (PlannerSettings.solo_pulls_for_seeds):
    it will serve once loaded, so its pull should run at the seed's full rate."""
    return setting and body.serves_after > 0


def same_node(body: wire.AssignmentRequest, r: Any) -> bool:
    """Whether the requester may be on the seed row's node: the same node label, or none given (a
    requester that names no node is not judged; rfork's loaders always name theirs)."""
    return not body.labels.node or body.labels.node == r.node


def pull_limit(max_concurrent_pulls: int, solo: bool) -> int:
    """A seed's pull limit as one requester sees it: 1 for a solo requester."""
    return min(max_concurrent_pulls, 1) if solo else max_concurrent_pulls


def _seed_view(r: Any, solo: bool = False) -> SeedView:
    """A candidate row (planner.queries' candidates) as the policy sees it (its limit as `pull_limit`)."""
    return SeedView(
        instance_id=r.id,
        node=r.node,
        rack=r.rack,
        zone=r.zone,
        active_leases=r.active,
        max_concurrent_pulls=pull_limit(r.max_concurrent_pulls, solo),
    )
