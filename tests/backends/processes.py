"""How the backends tests start peer processes: forked from a server that imported torch and numpy once.

A spawned Python process imports torch afresh, which takes seconds on a loaded 2-core box (and the
tests start dozens); a child forked from the forkserver has it already and starts in milliseconds.
The server imports nothing that opens libfabric, starts threads or touches CUDA, so each child
initialises its own transport, as a spawned one would. (CUDA tests keep "spawn".)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

from tests.waiting import wait_until

CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "numpy"])


def stop_process(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP pid and return once every one of its threads has stopped.

    The signal is asynchronous: a thread busy in the kernel when it arrives (first-touch page faults
    on this VM take tens of ms) delays the group stop, and meanwhile the process's native progress
    thread, which needs no GIL, goes on answering peers.
    """
    os.kill(pid, signal.SIGSTOP)

    def all_stopped() -> bool:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # a thread that just exited
            states.append(stat[stat.rindex(")") + 2])
        return bool(states) and all(s in "tT" for s in states)

    try:
        wait_until(all_stopped, timeout_s, f"every thread of process {pid} stopped", every_s=0.002)
    except AssertionError:
        # a TimeoutError, as before: some callers run this inside a pull's hooks
        raise TimeoutError(f"process {pid} did not stop within {timeout_s}s") from None
