"""A raw peer process (tests/backends/peer.py) standing in for a KV sender: how a receiver joins it."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from backends.kv import KvReceiver
from tests.backends.conftest import Peer


def welcome(rx: KvReceiver, raw: Peer, timeout_s: float = 10.0) -> None:
    """Join `raw` from rx: the raw peer answers the hello with a welcome, as a sender would."""
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(rx.join, raw.address, timeout_s)
        deadline = time.monotonic() + timeout_s
        while raw.address not in rx._joins and not joined.done() and time.monotonic() < deadline:
            time.sleep(0.005)
        data = json.dumps({"layers": rx.pool.geometry.layers}).encode()
        assert raw.call("send", rx.engine.address, "kv", "welcome", data) is True
        joined.result(timeout_s)
