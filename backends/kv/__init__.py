"""Paged KV-cache transfer for disaggregated prefill/decode (docs/kv.md).

`pool` (geometry, the registered pool, a layer's page spans), `messages` (the handshake on the
engine channel "kv"), `sender` (prefill side), `receiver` (decode side).
"""

from backends.kv.pool import MAX_LAYERS, KvError, KvGeometry, KvPool, layer_spans
from backends.kv.receiver import IncomingRequest, KvReceiver
from backends.kv.sender import KvSender, OutgoingRequest

__all__ = [
    "MAX_LAYERS",
    "IncomingRequest",
    "KvError",
    "KvGeometry",
    "KvPool",
    "KvReceiver",
    "KvSender",
    "OutgoingRequest",
    "layer_spans",
]
