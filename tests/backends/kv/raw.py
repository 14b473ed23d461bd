"""A raw peer process (tests/backends/peer.py) standing in for a KV sender: how a receiver joins it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from backends.kv import KvReceiver
from tests.backends.conftest import Peer
from tests.waiting import wait_until


def welcome(rx: KvReceiver, raw: Peer, timeout_s: float = 10.0) -> None:
    """Join `raw` from rx: the raw peer answers the hello with a welcome, as a sender would."""
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(rx.join, raw.address, timeout_s)
        wait_until(lambda: raw.address in rx._joins or joined.done(), timeout_s, "rx's hello", every_s=0.005)
        data = json.dumps({"layers": rx.pool.geometry.layers}).encode()
        assert raw.call("send", rx.engine.address, "kv", "welcome", data) is True
        joined.result(timeout_s)
