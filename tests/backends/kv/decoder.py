"""A decode instance in its own (spawned) process for the KV end-to-end tests, driven over a pipe.

It builds the same small Llama as the test (deterministic synthetic weights), keeps a paged KV pool
registered with its own engine, joins the prefill instance as a KvReceiver, and decodes from the
pages the prefill instance wrote into its pool.
"""

from __future__ import annotations

import hashlib
import os
from multiprocessing.connection import Connection
from typing import Any

import torch

from tests.backends.models import LlamaConfig, synthetic_tensor
from tests.tiny_llama import LlamaForCausalLM, PagedKvCache, greedy_decode

# not tests.tiny_llama.SMALL, on purpose: 2 attention heads give a head dim of 128, so a 16-token page
# is 8 KiB, above shm's 4 KiB inject size (PAGE_TOKENS)
TINY = LlamaConfig(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=512,
)
PAGE_TOKENS = 16  # 16 tokens x 2 KV heads x 128 dims x bf16 = 8 KiB pages (above shm's 4 KiB inject size)


def build_model(cfg: LlamaConfig = TINY) -> LlamaForCausalLM:
    """The small Llama with weights that depend only on parameter names (equal in every process).

    Matrices are scaled x16 from the checkpoint generator's std 0.02: at that std greedy decoding
    repeats one token, which would not show whether the cache was read correctly.
    """
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(synthetic_tensor(name, "bfloat16", tuple(param.shape), seed=7))
            if "norm" not in name:
                param.mul_(16)
    return model.eval()


def page_bytes(cfg: LlamaConfig = TINY) -> int:
    return PAGE_TOKENS * cfg.num_key_value_heads * cfg.head_dim * 2


def pages_digest(pool: torch.Tensor, pages: list[int], tokens: int) -> str:
    """sha1 of the first `tokens` positions of every layer's K and V held in `pages` (in order)."""
    h = hashlib.sha1()
    npages = -(-tokens // PAGE_TOKENS)
    for layer in range(pool.shape[0]):
        for kv in (0, 1):
            rows = pool[layer, kv].index_select(0, torch.tensor(pages[:npages])).flatten(0, 1)[:tokens]
            h.update(rows.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def serve(conn: Connection, provider: str, pages: int, name: str) -> None:
    """Open an engine and a pool, then obey ("join", addr), ("decode", ...), ("exit",)."""
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    torch.set_num_threads(1)
    from backends import TransferEngine, TransferError
    from backends.kv import KvPool, KvReceiver

    kw: dict[str, Any] = {"host": "127.0.0.1"} if provider == "tcp" else {}
    model = build_model()
    pool_t = PagedKvCache.allocate(TINY, pages, PAGE_TOKENS)
    with TransferEngine(provider, 2, timeout_s=8.0, reorder_for_test=True, **kw) as eng:
        pool = KvPool(eng, layers=TINY.num_hidden_layers, pages=pages, page_bytes=page_bytes(), buffer=pool_t)
        receiver = KvReceiver(pool, name=name, timeout_s=30.0)
        conn.send(eng.address)
        while True:
            cmd, *args = conn.recv()
            if cmd == "exit":
                break
            try:
                if cmd == "join":
                    receiver.join(args[0])
                    conn.send(True)
                elif cmd == "decode":
                    # (sender, request id, dst pages, first token, prompt length, steps)
                    sender, rid, dst_pages, first, prompt_len, steps = args
                    req = receiver.request(sender, rid, dst_pages)
                    conn.send("requested")
                    cache = PagedKvCache(pool_t, dst_pages)
                    layers_seen: list[int] = []

                    def before_layer(i: int, req: Any = req, seen: list[int] = layers_seen) -> None:
                        # Decode starts on layer i as soon as it landed, while later layers travel.
                        req.wait_layer(i)
                        seen.append(i)
                        conn.send(("layer", i))

                    tokens = greedy_decode(model, first, prompt_len, steps, cache, before_layer=before_layer)
                    req.wait()
                    # Positions < prompt_len are exactly what the sender wrote (decode appends after them).
                    digest = pages_digest(pool_t, dst_pages, prompt_len)
                    conn.send(("tokens", tokens, layers_seen, digest))
                else:
                    conn.send(f"unknown command {cmd}")
            except TransferError as exc:
                conn.send(("error", type(exc).__name__, str(exc)))
