"""Keep Python's signal handlers across libfabric initialisation.

Opening a libfabric domain can install C-level handlers (the shm provider cleans up its shared memory
on SIGINT/SIGTERM and friends), replacing the Python handlers the application set: a seed's SIGTERM
would then end the process without draining. `preserved_signal_handlers()` records the Python-level
handlers before and puts back any that changed. Python allows that only on the main thread; elsewhere
it logs what it could not restore.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

WATCHED = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGPIPE", "SIGABRT")
    if hasattr(signal, name)
)


@contextlib.contextmanager
def preserved_signal_handlers() -> Iterator[None]:
    """Run the body, then reinstall the Python handlers it displaced (main thread only)."""
    before: dict[int, Any] = {}
    for sig in WATCHED:
        with contextlib.suppress(ValueError, OSError):
            before[sig] = signal.getsignal(sig)
    try:
        yield
    finally:
        _restore(before)


def _restore(before: dict[int, Any]) -> None:
    on_main = threading.current_thread() is threading.main_thread()
    for sig, handler in before.items():
        if handler is None:  # installed outside Python: getsignal cannot tell, leave it
            continue
        if not on_main:
            log.debug("not on the main thread: cannot re-check the handler of signal %d", sig)
            continue
        try:
            # set it again even if getsignal still reports it: libfabric replaces the C-level
            # handler with sigaction, which Python's bookkeeping does not see
            signal.signal(sig, handler)
        except (ValueError, OSError, TypeError):
            log.warning("could not restore the handler of signal %d after opening libfabric", sig)
