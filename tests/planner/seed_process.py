"""A seed as a separate process for the planner's trust tests (run: python -m tests.planner.seed_process).

It registers with the token in $SEED_TOKEN at $PLANNER_URL, publishes the conftest manifest as loaded
from disk, goes READY and heartbeats; when the planner asks it to re-verify it republishes the same
digests, which is all a lying seed has to do (it would serve other bytes). With SEED_CONTROL=1 it runs
a real control endpoint (rfork.seed.control.ControlServer, GET /v1/health) and registers its URL;
SEED_CONTROL_URL registers that URL instead (one nobody answers: a seed whose probe fails).
Prints `READY <instance id>` once READY; exits when its stdin closes.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from planner.contract import PlannerClient
from rfork.seed.control import ControlServer
from tests.planner.conftest import identity, manifest, ranks


def main() -> None:
    url, token = os.environ["PLANNER_URL"], os.environ["SEED_TOKEN"]
    control = (
        ControlServer(tensors_for_rank=lambda _rank: []).start() if os.environ.get("SEED_CONTROL") else None
    )
    client = PlannerClient(url, token=token)
    control_url = os.environ.get("SEED_CONTROL_URL") or (None if control is None else control.url)
    reg = client.register_instance(identity=identity(), ranks=ranks(0), control_url=control_url)
    client.use_token(reg.token)
    client.put_manifest(reg.id, 0, manifest(0))
    client.set_status(reg.id, "READY")
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.2):
            if client.heartbeat(reg.id).reverify:
                client.put_manifest(reg.id, 0, manifest(0))  # "re-verified": the honest digests again

    threading.Thread(target=beat, daemon=True).start()
    print("READY", reg.id, flush=True)
    sys.stdin.read()
    stop.set()
    if control is not None:
        control.close()
    time.sleep(0.1)


if __name__ == "__main__":
    main()
