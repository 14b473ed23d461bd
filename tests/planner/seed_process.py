"""A seed as a separate process for the planner's trust tests (run: python -m tests.planner.seed_process).

It registers with the token in $SEED_TOKEN at $PLANNER_URL, publishes the conftest manifest as loaded
from disk, goes READY and heartbeats; when the planner asks it to re-verify it republishes the same
digests, which is all a lying seed has to do (it would serve other bytes). With SEED_CONTROL=1 it runs
an HTTP endpoint answering GET /v1/health as a seed's control endpoint does, and registers its URL;
SEED_CONTROL_URL registers that URL instead (one nobody answers: a seed whose probe fails).
Prints `READY <instance id>` once READY; exits when its stdin closes.
"""

from __future__ import annotations

import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from planner.contract import PlannerClient
from tests.planner.conftest import identity, manifest, ranks


class _Health(BaseHTTPRequestHandler):
    """GET /v1/health -> 200, as a seed's control endpoint answers it (rfork.seed.control; the planner's
    tests import no rfork, so the probe's target is this stand-in)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        ok = self.path == "/v1/health"
        body = b'{"status": "ok"}' if ok else b"{}"
        self.send_response(200 if ok else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


def main() -> None:
    url, token = os.environ["PLANNER_URL"], os.environ["SEED_TOKEN"]
    control = ThreadingHTTPServer(("127.0.0.1", 0), _Health) if os.environ.get("SEED_CONTROL") else None
    if control is not None:
        threading.Thread(target=control.serve_forever, daemon=True).start()
    client = PlannerClient(url, token=token)
    control_url = os.environ.get("SEED_CONTROL_URL") or (
        None if control is None else f"http://127.0.0.1:{control.server_address[1]}"
    )
    reg = client.register_instance(identity=identity(), ranks=ranks(0), control_url=control_url)
    client.use_token(reg.token)
    client.put_manifest(reg.id, 0, manifest(0))
    client.set_status(reg.id, "READY")
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.2):
            if client.heartbeat(reg.id).reverify:
                client.put_manifest(reg.id, 0, manifest(0))  # "re-verified": the honest digests again

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    print("READY", reg.id, flush=True)
    sys.stdin.read()
    stop.set()
    if control is not None:
        control.shutdown()
    beater.join(10)  # a heartbeat in flight ends before the process does


if __name__ == "__main__":
    main()
