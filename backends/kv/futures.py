"""Settling a request's future from the transport's futures: the first settlement wins."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future

from backends.errors import TransferError
from backends.kv.pool import KvError

log = logging.getLogger(__name__)


def fail(fut: Future[None], exc: BaseException) -> None:
    """Fail fut unless it is already settled."""
    if not fut.done():
        try:
            fut.set_exception(exc)
        except Exception:  # noqa: BLE001 - lost a race with another completion; first one wins
            log.debug("future already settled", exc_info=True)


def settle(target: Future[None], source: Future[None], what: str) -> None:
    """Settle target as source settled; an error keeps its type and gains `what` in front."""
    exc = source.exception()
    if exc is None:
        if not target.done():
            try:
                target.set_result(None)
            except Exception:  # noqa: BLE001 - first settlement wins
                log.debug("future already settled", exc_info=True)
    else:
        err = exc if isinstance(exc, TransferError) else TransferError(str(exc))
        fail(target, type(err)(f"{what}: {err}"))


def settle_error(target: Future[None], source: Future[None], what: str) -> None:
    """Fail target with a KvError when source failed (its success says nothing about target)."""
    exc = source.exception()
    if exc is not None:
        fail(target, KvError(f"{what}: {exc}"))


def log_failure(what: str) -> Callable[[Future[None]], None]:
    """A done-callback that logs a failed future (for replies nobody waits on)."""

    def cb(f: Future[None]) -> None:
        if f.exception() is not None:
            log.warning("%s failed: %s", what, f.exception())

    return cb
