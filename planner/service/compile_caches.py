"""Compile caches: the archive digest an authority anchored per key, and which READY instances of the
key's identity serve it, with a one-fetch token each (routes/compile_caches.py).

An archive holds code the engine imports (inductor `.py`/`.so`), so it is trusted like weights: a key
is offered only once an authority set its archive digest (an admin upload, or the first publication of
an anchor-role instance that serves the key), only from instances of the key's identity whose every
manifest matches its anchor, and the loader installs only an archive with that digest. A key is bound
to its identity (wire.compile_cache_key): an authority shows the key's variant and anchors its own
identity's keys only, and a loader names the identity it asks for. Sources are ranked by the loaders'
reports of earlier fetches (decoys that copy a manifest and list the key go after the seeds that served).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import and_, delete, exists, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from planner.auth import Principal
from planner.contract import control_token, views, wire
from planner.contract.errors import AuthError, Conflict, NoSource, NotFound
from planner.models import Anchor, CompileCache, CompileCacheAnchor, Instance, Manifest
from planner.service.base import ServiceState, rowcount

log = logging.getLogger(__name__)


class CompileCacheOps(ServiceState):
    """Planner's compile-cache anchors and sources."""

    def anchor_compile_cache(
        self, cache_key: str, body: wire.CompileCacheAnchorUpload, now: float, *, principal: Principal
    ) -> views.CompileCacheAnchorView:
        """Set the archive digest of `cache_key`; the first authority wins (see CompileCacheAnchorUpload).

        AuthError 403 for a caller that is neither an admin nor an anchor-role instance serving the key;
        Conflict for a digest other than the anchored one, a missing or foreign identity, or a key that
        is not the identity's (wire.compile_cache_key of the identity and `body.key_variant`).
        """
        with self.db.write() as s:
            if principal.has("admin"):
                if body.identity_key is None:
                    raise Conflict("identity_key: an upload names the identity whose instances serve the key")
                identity_key, instance_id = body.identity_key, principal.instance_id or ""
            else:
                inst = None if principal.instance_id is None else s.get(Instance, principal.instance_id)
                if inst is None or not inst.may_anchor or body.replace:
                    raise AuthError(
                        f"compile cache {cache_key[:12]}: only an admin, or an instance registered with the"
                        " anchor role (once), sets an archive digest",
                        status=403,
                    )
                if cache_key not in {c.cache_key for c in inst.compile_caches}:
                    raise Conflict(f"compile cache {cache_key[:12]}: instance {inst.id} does not serve it")
                if body.identity_key not in (None, inst.identity_key):
                    raise Conflict("identity_key: an instance anchors keys of its own identity only")
                identity_key, instance_id = inst.identity_key, inst.id
            if wire.compile_cache_key(identity_key, body.key_variant) != cache_key:
                raise Conflict(
                    f"compile cache {cache_key[:12]} is not a key of identity {identity_key[:12]} (with"
                    f" key_variant {body.key_variant[:12]}): an authority anchors its identity's keys only"
                )
            held = s.get(CompileCacheAnchor, cache_key)
            # the instance that anchored the key may move its anchor to its own newer archive: a cache
            # keeps growing after it first settles (vLLM compiles more), and no one else may move it
            mover = "" if principal.has("admin") else instance_id
            moves_own = (
                held is not None and mover != "" and held.instance_id == mover
                and held.archive_digest != body.archive_digest  # the same digest again: a no-op
            )
            values = {
                "cache_key": cache_key,
                "identity_key": identity_key,
                "archive_digest": body.archive_digest,
                "instance_id": instance_id,
                "created_at": now,
                "set_by": principal.holder,
            }
            if body.replace or moves_own:
                s.execute(delete(CompileCacheAnchor).where(CompileCacheAnchor.cache_key == cache_key))
            stmt = (sqlite_insert if self.db.sqlite else pg_insert)(CompileCacheAnchor).values(**values)
            won = stmt.on_conflict_do_nothing().returning(CompileCacheAnchor.cache_key)
            inserted = s.connection().execute(won).first() is not None
            row = s.execute(
                select(CompileCacheAnchor)
                .where(CompileCacheAnchor.cache_key == cache_key)
                .execution_options(populate_existing=True)
            ).scalar_one()
            if (row.identity_key, row.archive_digest) != (identity_key, body.archive_digest):
                raise Conflict(
                    f"compile cache {cache_key[:12]} is anchored with another archive digest or identity"
                    f" (set by {row.set_by}); an admin may replace it"
                )
            view = _view(row)
        if inserted:
            log.info("compile cache %s anchored by %s", cache_key[:12], principal.holder)
        return view

    def report_compile_cache(
        self, cache_key: str, body: wire.CompileCacheReport, *, may_lease: Callable[[str], bool]
    ) -> None:
        """Count a loader's fetch of `cache_key` from `body.instance_id` as verified or failed: the
        evidence sources are ranked by. NotFound when the key is not anchored for an identity the
        caller may load, or the instance does not serve it."""
        column = CompileCache.served if body.outcome == "verified" else CompileCache.failed
        with self.db.write() as s:
            anchor = s.get(CompileCacheAnchor, cache_key)
            if anchor is None or not may_lease(anchor.identity_key):
                raise NotFound(f"compile cache {cache_key[:12]} is not anchored for this token", status=404)
            done = s.execute(
                update(CompileCache)
                .where(CompileCache.cache_key == cache_key, CompileCache.instance_id == body.instance_id)
                .values({column: column + 1})
            )
            if not rowcount(done):
                raise NotFound(
                    f"instance {body.instance_id} does not serve compile cache {cache_key[:12]}", status=404
                )
        log.log(
            logging.INFO if body.outcome == "verified" else logging.WARNING,
            "compile cache %s from %s: %s%s",
            cache_key[:12],
            body.instance_id,
            body.outcome,
            f" ({body.error})" if body.error else "",
        )

    def compile_cache_sources(
        self, cache_key: str, body: wire.CompileCacheRequest, now: float, *, may_lease: Callable[[str], bool]
    ) -> wire.CompileCacheSources:
        """The anchored digest of `cache_key` and the READY, unquarantined instances serving it that hold
        the key's identity with every manifest anchored, none of `body.exclude`, each with a control
        token for one fetch of this key (planner.contract.control_token: no weight session). Ranked by
        evidence (`evidence_tier`), then same node, rack, zone first: decoys that copy an anchored
        manifest and list the key never crowd out the seed that served it.

        `body.identity_key`: the identity the requester asks for; `may_lease(identity_key)`: whether the
        caller may have that identity's artifacts (an instance token: its own identity only). NotFound
        `not_anchored` when no authority set the key's digest for that identity; NoSource (404) when no
        instance is left.
        """
        labels = body.labels
        with self.db.read() as s:
            anchor = s.get(CompileCacheAnchor, cache_key)
            if anchor is None or anchor.identity_key != body.identity_key:
                raise NotFound(
                    f"compile cache {cache_key[:12]} has no anchored archive digest for identity"
                    f" {body.identity_key[:12]} (an anchor-role seed of it publishes one once it compiled,"
                    " or an admin uploads it): nothing to fetch",
                    status=404,
                    reason="not_anchored",
                )
            if not may_lease(anchor.identity_key):
                raise NoSource(f"no READY instance serves compile cache {cache_key[:12]} to this token")
            identity_key, digest, anchored_by = anchor.identity_key, anchor.archive_digest, anchor.instance_id
            matches_anchor = and_(
                Anchor.identity_key == Instance.identity_key,
                Anchor.rank == Manifest.rank,
                Anchor.checksum_algorithm == Manifest.checksum_algorithm,
                Anchor.digest_set == Manifest.digest_set,
            )
            anchored = exists().where(Manifest.instance_id == Instance.id, matches_anchor)
            unanchored = exists().where(Manifest.instance_id == Instance.id, ~exists().where(matches_anchor))
            q = (
                select(Instance, CompileCache.served, CompileCache.failed)
                .join(CompileCache, CompileCache.instance_id == Instance.id)
                .where(
                    CompileCache.cache_key == cache_key,
                    Instance.identity_key == identity_key,
                    Instance.status == "READY",
                    Instance.last_heartbeat >= now - self.settings.heartbeat_ttl_s,
                    or_(Instance.quarantined_until.is_(None), Instance.quarantined_until <= now),
                    Instance.accused_since.is_(None),  # an accused seed serves no compile cache either
                    Instance.reverify_since.is_(None),
                    Instance.integrity_failed.is_(False),
                    Instance.control_url.is_not(None),
                    Instance.control_key.is_not(None),
                    anchored,
                    ~unanchored,
                )
                .order_by(Instance.id)
            )
            if body.exclude:
                q = q.where(Instance.id.not_in(body.exclude))
            found = list(s.execute(q).all())
        if not found:
            raise NoSource(f"no READY instance of its identity with anchored weights serves compile cache"
                           f" {cache_key[:12]}")
        found.sort(
            key=lambda r: (
                evidence_tier(r.Instance.id, r.served, r.failed, anchored_by),
                r.Instance.node != labels.node,
                r.Instance.rack != labels.rack,
                r.Instance.zone != labels.zone,
            )
        )
        rows = [r.Instance for r in found]
        expires_at = now + self.settings.lease_ttl_s
        sources = [
            wire.CompileCacheSource(
                instance_id=i.id,
                control_url=str(i.control_url),
                labels=wire.Labels(node=i.node, rack=i.rack, zone=i.zone),
                control_token=control_token.issue_compile_cache(
                    control_token.unseal(self._control_secret, i.id, str(i.control_key)),
                    instance_id=i.id,
                    cache_key=cache_key,
                    expires_at=expires_at,
                ),
            )
            for i in rows[:8]
        ]
        return wire.CompileCacheSources(cache_key=cache_key, archive_digest=digest, sources=sources)


def evidence_tier(instance_id: str, served: int, failed: int, anchored_by: str) -> int:
    """0: the instance whose own compile anchored the key; 1: loaders reported more verified fetches
    from it than failed ones; 2: no evidence either way; 3: more failed fetches than verified ones."""
    if instance_id == anchored_by:
        return 0
    if served > failed:
        return 1
    return 2 if failed == served else 3


def _view(row: CompileCacheAnchor) -> views.CompileCacheAnchorView:
    return views.CompileCacheAnchorView(
        cache_key=row.cache_key,
        identity_key=row.identity_key,
        archive_digest=row.archive_digest,
        instance_id=row.instance_id,
        set_by=row.set_by,
        created_at=row.created_at,
    )
