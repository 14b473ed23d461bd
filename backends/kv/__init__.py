"""Paged KV-cache transfer for disaggregated prefill/decode (docs/kv.md)."""

from backends.kv.transfer import (
    KV_IMM_TAG,
    MAX_LAYERS,
    IncomingRequest,
    KvError,
    KvGeometry,
    KvPool,
    KvReceiver,
    KvSender,
    OutgoingRequest,
    imm_for,
    layer_spans,
)

__all__ = [
    "KV_IMM_TAG",
    "MAX_LAYERS",
    "IncomingRequest",
    "KvError",
    "KvGeometry",
    "KvPool",
    "KvReceiver",
    "KvSender",
    "OutgoingRequest",
    "imm_for",
    "layer_spans",
]
