"""`rfork` with a slow disk (a test double: each checkpoint read takes SLOW_READ_S), run as
`python -m tests.rfork.cli.slow_disk ARGS...`.

It prints READING on stderr when the first read starts, so that a test signals the process mid-read
on that event, not after a guessed sleep. Reads are 256 KiB each: a checkpoint is many of them, so
a stop that read everything queued before exiting shows as a long exit.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from rfork.cli import main
from rfork.weights import checkpoint

READING = "READING"
SLOW_READ_S = 1.0
_started = threading.Event()
_preadv = os.preadv


def _slow_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
    if not _started.is_set():
        _started.set()
        print(READING, file=sys.stderr, flush=True)
    time.sleep(SLOW_READ_S)
    return _preadv(fd, buffers, offset)


if __name__ == "__main__":
    os.preadv = _slow_preadv  # type: ignore[assignment]
    checkpoint.READ_CHUNK_BYTES = 256 << 10
    sys.exit(main(sys.argv[1:]))
