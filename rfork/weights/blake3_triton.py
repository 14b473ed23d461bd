"""BLAKE3's compression as one Triton kernel: the optional fast path of rfork.weights.blake3_tensor.

One program hashes `BLOCK` items (1 KiB chunks, or parent nodes) to their chaining values: the state
and the message stay in registers through every block and round, so the input is read once and only
8 words per item are written. The chunks' tail and the tree's shape stay in blake3_tensor; this only
replaces the per-item compressions. Opt-in (`RFORK_BLAKE3_KERNEL=triton`) until a GPU run has checked
it against the `blake3` package; `TRITON_INTERPRET=1` runs the same kernel on CPU tensors (tested
here). Needs the `triton` package (shipped with CUDA builds of torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128


@triton.jit
def _g(a, b, c, d, mx, my):
    a = a + b + mx
    d = d ^ a
    d = (d >> 16) | (d << 16)
    c = c + d
    b = b ^ c
    b = (b >> 12) | (b << 20)
    a = a + b + my
    d = d ^ a
    d = (d >> 8) | (d << 24)
    c = c + d
    b = b ^ c
    b = (b >> 7) | (b << 25)
    return a, b, c, d


@triton.jit
def _compress_items(
    msg_ptr,
    out_ptr,
    n_items,
    item_stride,
    counter_step,
    base_flags,
    first_flags,
    last_flags,
    N_BLOCKS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[i, 0:8] = the chaining value of item i: N_BLOCKS 64-byte blocks at msg + i * item_stride
    (uint32 words), chained from the IV; counter = i * counter_step; flags = base_flags, plus
    first_flags on block 0 and last_flags on the last block (block lengths are all 64)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_items
    item = offs.to(tl.int64)
    base = msg_ptr + item * item_stride
    counter = item * counter_step
    c_lo = (counter & 0xFFFFFFFF).to(tl.uint32)
    c_hi = (counter >> 32).to(tl.uint32)
    zero = tl.zeros([BLOCK], dtype=tl.uint32)
    h0 = zero + 0x6A09E667
    h1 = zero + 0xBB67AE85
    h2 = zero + 0x3C6EF372
    h3 = zero + 0xA54FF53A
    h4 = zero + 0x510E527F
    h5 = zero + 0x9B05688C
    h6 = zero + 0x1F83D9AB
    h7 = zero + 0x5BE0CD19
    for blk in range(N_BLOCKS):  # a loop, not unrolled: 1/16 of the code to compile
        p = base + blk * 16
        m0 = tl.load(p + 0, mask=mask, other=0)
        m1 = tl.load(p + 1, mask=mask, other=0)
        m2 = tl.load(p + 2, mask=mask, other=0)
        m3 = tl.load(p + 3, mask=mask, other=0)
        m4 = tl.load(p + 4, mask=mask, other=0)
        m5 = tl.load(p + 5, mask=mask, other=0)
        m6 = tl.load(p + 6, mask=mask, other=0)
        m7 = tl.load(p + 7, mask=mask, other=0)
        m8 = tl.load(p + 8, mask=mask, other=0)
        m9 = tl.load(p + 9, mask=mask, other=0)
        m10 = tl.load(p + 10, mask=mask, other=0)
        m11 = tl.load(p + 11, mask=mask, other=0)
        m12 = tl.load(p + 12, mask=mask, other=0)
        m13 = tl.load(p + 13, mask=mask, other=0)
        m14 = tl.load(p + 14, mask=mask, other=0)
        m15 = tl.load(p + 15, mask=mask, other=0)
        is_first = (N_BLOCKS - blk) // N_BLOCKS  # 1 for block 0, else 0 (integer ops: also interpreted)
        is_last = (blk + 1) // N_BLOCKS  # 1 for the last block, else 0
        flags = base_flags | (first_flags * is_first) | (last_flags * is_last)
        v0, v1, v2, v3, v4, v5, v6, v7 = h0, h1, h2, h3, h4, h5, h6, h7
        v8 = zero + 0x6A09E667
        v9 = zero + 0xBB67AE85
        v10 = zero + 0x3C6EF372
        v11 = zero + 0xA54FF53A
        v12 = c_lo
        v13 = c_hi
        v14 = zero + 64
        v15 = zero + flags
        v0, v4, v8, v12 = _g(v0, v4, v8, v12, m0, m1)
        v1, v5, v9, v13 = _g(v1, v5, v9, v13, m2, m3)
        v2, v6, v10, v14 = _g(v2, v6, v10, v14, m4, m5)
        v3, v7, v11, v15 = _g(v3, v7, v11, v15, m6, m7)
        v0, v5, v10, v15 = _g(v0, v5, v10, v15, m8, m9)
        v1, v6, v11, v12 = _g(v1, v6, v11, v12, m10, m11)
        v2, v7, v8, v13 = _g(v2, v7, v8, v13, m12, m13)
        v3, v4, v9, v14 = _g(v3, v4, v9, v14, m14, m15)
        v0, v4, v8, v12 = _g(v0, v4, v8, v12, m2, m6)
        v1, v5, v9, v13 = _g(v1, v5, v9, v13, m3, m10)
        v2, v6, v10, v14 = _g(v2, v6, v10, v14, m7, m0)
        v3, v7, v11, v15 = _g(v3, v7, v11, v15, m4, m13)
        v0, v5, v10, v15 = _g(v0, v5, v10, v15, m1, m11)
        v1, v6, v11, v12 = _g(v1, v6, v11, v12, m12, m5)
        v2, v7, v8, v13 = _g(v2, v7, v8, v13, m9, m14)
        v3, v4, v9, v14 = _g(v3, v4, v9, v14, m15, m8)
        v0, v4, v8, v12 = _g(v0, v4, v8, v12, m3, m4)
        v1, v5, v9, v13 = _g(v1, v5, v9, v13, m10, m12)
        v2, v6, v10, v14 = _g(v2, v6, v10, v14, m13, m2)
        v3, v7, v11, v15 = _g(v3, v7, v11, v15, m7, m14)
        v0, v5, v10, v15 = _g(v0, v5, v10, v15, m6, m5)
        v1, v6, v11, v12 = _g(v1, v6, v11, v12, m9, m0)
        v2, v7, v8, v13 = _g(v2, v7, v8, v13, m11, m15)
        v3, v4, v9, v14 = _g(v3, v4, v9, v14, m8, m1)
        v0, v4, v8, v12 = _g(v0, v4, v8, v12, m10, m7)
        v1, v5, v9, v13 = _g(v1, v5, v9, v13, m12, m9)
        v2, v6, v10, v14 = _g(v2, v6, v10, v14, m14, m3)
        v3, v7, v11, v15 = _g(v3, v7, v11, v15, m13, m15)
        v0, v5, v10, v15 = _g(v0, v5, v10, v15, m4, m0)
        v1, v6, v11, v12 = _g(v1, v6, v11, v12, m11, m2)
        v2, v7, v8, v13 = _g(v2, v7, v8, v13, m5, m8)
        v3, v4, v9, v14 = _g(v3, v4, v9, v14, m1, m6)
        v0, v4, v8, v12 = _g(v0, v4, v8, v12, m12, m13)
        v1, v5, v9, v13 = _g(v1, v5, v9, v13, m9, m11)
        v2, v6, v10, v14 = _g(v2, v6, v10, v14, m15, m10)
        v3, v7, v11, v15 = _g(v3, v7, v11, v15, m14, m8)
        v0, v5, v10, v15 = _g(v0, v5, v10, v15, m7, m2)
        v1, v6, v11, v12 = _g(v1, v6, v11, v12, m5, m3)
        v2, v7, v8, v13 = _g(v2, v7, v8, v13, m0, m1)
        v3, v4, v9, v14 = _g(v3, v4, v9, v14, m6, m4)
        v0, v4, v8, v12 = _g(v0, v4, v8, v12, m9, m14)
        v1, v5, v9, v13 = _g(v1, v5, v9, v13, m11, m5)
        v2, v6, v10, v14 = _g(v2, v6, v10, v14, m8, m12)
        v3, v7, v11, v15 = _g(v3, v7, v11, v15, m15, m1)
        v0, v5, v10, v15 = _g(v0, v5, v10, v15, m13, m3)
        v1, v6, v11, v12 = _g(v1, v6, v11, v12, m0, m10)
        v2, v7, v8, v13 = _g(v2, v7, v8, v13, m2, m6)
        v3, v4, v9, v14 = _g(v3, v4, v9, v14, m4, m7)
        v0, v4, v8, v12 = _g(v0, v4, v8, v12, m11, m15)
        v1, v5, v9, v13 = _g(v1, v5, v9, v13, m5, m0)
        v2, v6, v10, v14 = _g(v2, v6, v10, v14, m1, m9)
        v3, v7, v11, v15 = _g(v3, v7, v11, v15, m8, m6)
        v0, v5, v10, v15 = _g(v0, v5, v10, v15, m14, m10)
        v1, v6, v11, v12 = _g(v1, v6, v11, v12, m2, m12)
        v2, v7, v8, v13 = _g(v2, v7, v8, v13, m3, m4)
        v3, v4, v9, v14 = _g(v3, v4, v9, v14, m7, m13)
        h0 = v0 ^ v8
        h1 = v1 ^ v9
        h2 = v2 ^ v10
        h3 = v3 ^ v11
        h4 = v4 ^ v12
        h5 = v5 ^ v13
        h6 = v6 ^ v14
        h7 = v7 ^ v15
    out = out_ptr + item * 8
    tl.store(out + 0, h0, mask=mask)
    tl.store(out + 1, h1, mask=mask)
    tl.store(out + 2, h2, mask=mask)
    tl.store(out + 3, h3, mask=mask)
    tl.store(out + 4, h4, mask=mask)
    tl.store(out + 5, h5, mask=mask)
    tl.store(out + 6, h6, mask=mask)
    tl.store(out + 7, h7, mask=mask)


def compress_items(
    msg: torch.Tensor,
    *,
    n_items: int,
    item_stride: int,
    n_blocks: int,
    counter_step: int,
    base_flags: int,
    first_flags: int,
    last_flags: int,
) -> torch.Tensor:
    """Chaining values [n_items, 8] (uint32 as int32) of items laid out in `msg` (int32 words)."""
    out = torch.empty((n_items, 8), dtype=torch.int32, device=msg.device)
    if n_items:
        grid = (triton.cdiv(n_items, BLOCK),)
        _compress_items[grid](
            msg.view(torch.uint32),
            out.view(torch.uint32),
            n_items,
            item_stride,
            counter_step,
            base_flags,
            first_flags,
            last_flags,
            N_BLOCKS=n_blocks,
            BLOCK=BLOCK,
        )
    return out
