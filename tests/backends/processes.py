"""How the backends tests start peer processes: forked from a server that imported torch and numpy once.

A spawned Python process imports torch afresh, which takes seconds on a loaded 2-core box (and the
tests start dozens); a child forked from the forkserver has it already and starts in milliseconds.
The server imports nothing that opens libfabric, starts threads or touches CUDA, so each child
initialises its own transport, as a spawned one would. (CUDA tests keep "spawn".)
"""

from __future__ import annotations

import multiprocessing as mp

CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "numpy"])
