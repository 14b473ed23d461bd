"""A seed anchors its compile caches at the planner once they are settled (the anchor role's half).

Loaders install only an archive whose digest an authority set (planner.service.compile_caches). A seed
registered with the anchor role is such an authority for the keys it serves: once the engine has
compiled and the directory settled, it packs it and publishes the digest; the first authority wins. A
seed without the role is refused (403) and stops trying: its caches are fetched only if an admin or an
anchor seed anchored the same key with the same bytes. Called from the heartbeat thread; thread-safe.
"""

from __future__ import annotations

import logging
import threading

from planner.contract import AuthError, Conflict, PlannerClient
from rfork.compile_cache.archive import CompileCacheError
from rfork.compile_cache.shelf import CacheShelf

log = logging.getLogger(__name__)


class CacheAnchoring:
    """Publishes each key's archive digest when the shelf can pack it, and again when the packed archive
    changed (the engine compiled more after the directory first settled)."""

    def __init__(self, shelf: CacheShelf) -> None:
        self.shelf = shelf
        self._done: dict[str, str] = {}  # key -> the digest last published (or refused) for it
        self._anchored: set[str] = set()  # keys whose digest this process set
        self._refused = False
        self._lock = threading.Lock()

    def publish(self, client: PlannerClient, identity_key: str) -> None:
        """Anchor every settled key not anchored yet; PlannerError other than 403/409 propagates (retry)."""
        with self._lock:
            if self._refused:
                return
            for key in list(self.shelf.dirs):
                try:
                    digest = self.shelf.archive(key).digest  # packed again only when the directory changed
                except CompileCacheError:
                    continue  # nothing compiled yet, still being written, or over the limits
                if self._done.get(key) == digest:
                    continue
                try:
                    self._anchor(client, key, digest, identity_key)
                except AuthError as exc:
                    if exc.status != 403:
                        raise
                    log.info("compile cache %s not anchored: %s", key[:12], exc)
                    self._refused = True
                    return
                except Conflict as exc:
                    log.warning("compile cache %s: %s; loaders will not install this archive", key[:12], exc)
                else:
                    log.info("compile cache %s anchored with archive %s", key[:12], digest)
                    self._anchored.add(key)
                self._done[key] = digest

    def _anchor(self, client: PlannerClient, key: str, digest: str, identity_key: str) -> None:
        """An anchor-role instance moves its own anchor when its cache grew (the planner allows it);
        a seed holding an admin token (or any seed of an --insecure planner) replaces only a digest
        this process set itself."""
        variant = self.shelf.variants[key]
        try:
            client.anchor_compile_cache(key, digest, key_variant=variant, identity_key=identity_key)
        except Conflict as conflict:
            if key not in self._anchored:
                raise
            try:
                client.anchor_compile_cache(
                    key, digest, key_variant=variant, identity_key=identity_key, replace=True
                )
            except AuthError:  # not an admin: someone else moved it, and it stays theirs
                raise conflict from None
