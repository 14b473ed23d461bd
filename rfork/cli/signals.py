"""SIGINT and SIGTERM during a command's work: raise `rfork.Interrupted` in the main thread, so the
work unwinds (a pull reports `aborted` and frees its seed's slot at once, the engine closes) and the
command exits 128 + the signal with one line.

libfabric installs C-level handlers of its own the first time it is asked about providers (the shm
provider cleans up its shared memory on SIGINT/SIGTERM, then ends the process with status 1, no
output and the lease still held). `install()` is therefore called again once the transport has
been probed on the main thread (rfork.pull.checks.check_providers_present): a Python handler set
from the main thread replaces the C-level one.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

from rfork.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _raise(signum: int, _frame: Any) -> None:
    install(_ignore)  # a second Ctrl-C must not cut the clean-up (the lease's report) short
    raise Interrupted(signum)


def _ignore(_signum: int, _frame: Any) -> None:
    """Already stopping: the first signal's clean-up runs to its end (SIGKILL still ends it)."""


def install(handler: Callable[[int, Any], None] = _raise) -> None:
    """Set `handler` (default: raise Interrupted) for SIGINT and SIGTERM; main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        signal.signal(sig, handler)
