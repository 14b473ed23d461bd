"""BLAKE3 of a tensor's bytes, computed with torch integer ops on the tensor's own device.

The output is the standard BLAKE3 hash (32 bytes, 64 hex digits, the same as the `blake3` package),
so a digest anchored from disk on a host and one checked on a GPU agree, and no weight byte crosses
to the host. BLAKE3 splits the input into 1 KiB chunks, each hashed independently (16 compressions
of 64-byte blocks, chained) into a chaining value; the chaining values are then merged pairwise into
a binary tree. Both steps vectorise:

- chunks: the 1 KiB chunks of one pass are int32 words (little-endian) laid out as [16 blocks,
  16 words, chunks]; the compression function runs once per block over all chunks at once. Python
  loops only over the 16 blocks, the 7 rounds and the two half-rounds (column, diagonal); each step
  is a few elementwise ops over [4, chunks] tensors.
- tree: each level compresses all adjacent pairs at once; an odd last node moves up unchanged,
  which yields BLAKE3's left-balanced tree.

int32 arithmetic wraps modulo 2**32 (two's complement on CPU and CUDA); right shifts are arithmetic
in torch, so the rotations mask the sign's copies off. The state is lane-major ([16 words, chunks]), so
every operand is a set of contiguous rows; the input is transposed into that layout once per pass. A
pass covers up to `chunks_per_pass` chunks: 256 MiB on a GPU (enough to fill it; about 0.4 GiB of
scratch), 2 MiB on CPU (small operands stay in cache). The CPU path exists to test the same ops
bit for bit here; host tensors are hashed with the `blake3` package (rfork.weights.checksum).
Not constant-time, not keyed, no extendable output: a content digest only.
"""

from __future__ import annotations

import os
import threading

import torch

CHUNK_LEN = 1024
BLOCK_LEN = 64
CHUNK_START, CHUNK_END, PARENT, ROOT = 1, 2, 4, 8
IV = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)
MSG_PERMUTATION = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)
CUDA_CHUNKS_PER_PASS = 1 << 18  # 256 MiB of input per pass on a GPU: ~0.4 GiB of scratch
CPU_CHUNKS_PER_PASS = 1 << 11  # 2 MiB per pass on CPU: operands stay in L2, below torch's threading grain


def _i32(v: int) -> int:
    """A 32-bit constant as the signed int32 torch stores."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _schedule() -> list[int]:
    """Message word indices for all 7 rounds, round by round as (column x, column y, diagonal x,
    diagonal y), 4 each: one gather per block lays every round's operands out as contiguous rows."""
    order = list(range(16))
    flat: list[int] = []
    for _ in range(7):
        flat += order[0:8:2] + order[1:8:2] + order[8:16:2] + order[9:16:2]
        order = [order[i] for i in MSG_PERMUTATION]
    return flat


_ROT = {n: (1 << (32 - n)) - 1 for n in (16, 12, 8, 7)}  # masks for the logical part of `x >> n`
_DIAGONAL = [5, 6, 7, 4, 10, 11, 8, 9, 15, 12, 13, 14]  # state rows b, c, d shifted by 1, 2, 3 lanes


class _DeviceConstants:
    """Index tensors and the IV per device, built once."""

    def __init__(self, device: torch.device) -> None:
        self.schedule = torch.tensor(_schedule(), dtype=torch.int64, device=device)
        self.diagonal = torch.tensor(_DIAGONAL, dtype=torch.int64, device=device)
        self.iv = torch.tensor([_i32(v) for v in IV], dtype=torch.int32, device=device).reshape(8, 1)


_constants_lock = threading.Lock()
_constants: dict[torch.device, _DeviceConstants] = {}


def _device_constants(device: torch.device) -> _DeviceConstants:
    with _constants_lock:
        c = _constants.get(device)
        if c is None:
            c = _constants[device] = _DeviceConstants(device)
        return c


def _rotr_(x: torch.Tensor, n: int, tmp: torch.Tensor) -> None:
    """x = x rotated right by n bits (as uint32), in place."""
    torch.bitwise_right_shift(x, n, out=tmp)
    tmp.bitwise_and_(_ROT[n])
    x.bitwise_left_shift_(32 - n)
    x.bitwise_or_(tmp)


def _g(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    mx: torch.Tensor,
    my: torch.Tensor,
    tmp: torch.Tensor,
) -> None:
    """BLAKE3's G on four lanes of many blocks at once (each argument [4, blocks]), in place."""
    a.add_(b).add_(mx)
    d.bitwise_xor_(a)
    _rotr_(d, 16, tmp)
    c.add_(d)
    b.bitwise_xor_(c)
    _rotr_(b, 12, tmp)
    a.add_(b).add_(my)
    d.bitwise_xor_(a)
    _rotr_(d, 8, tmp)
    c.add_(d)
    b.bitwise_xor_(c)
    _rotr_(b, 7, tmp)


class _Compressor:
    """Scratch for compressing up to `cols` blocks at once on one device, reused across blocks and
    passes. Everything is lane-major ([words, blocks]): every operand is a set of contiguous rows."""

    def __init__(self, cols: int, device: torch.device) -> None:
        self.k = _device_constants(device)
        self.cols = cols
        self.v = torch.empty((16, cols), dtype=torch.int32, device=device)  # the state
        self.m = torch.empty((16 * 7, cols), dtype=torch.int32, device=device)  # scheduled message
        self.diag = torch.empty((12, cols), dtype=torch.int32, device=device)
        self.tmp = torch.empty((4, cols), dtype=torch.int32, device=device)

    def compress_(self, cv: torch.Tensor, block: torch.Tensor, d_init: torch.Tensor) -> None:
        """cv[:, :n] = the chaining values of compressing the blocks block[:, :n] (int32 [16, n]) under
        cv (int32 [8, n]); d_init ([4, n] or [4, 1]) is the state's last row: counter low, counter high,
        block length, flags."""
        n = cv.shape[1]
        v, m, diag, tmp = self.v[:, :n], self.m[:, :n], self.diag[:, :n], self.tmp[:, :n]
        k = self.k
        torch.index_select(block, 0, k.schedule, out=m)
        v[0:8].copy_(cv)
        v[8:12].copy_(k.iv[0:4])
        v[12:16].copy_(d_init)
        a, b, c, d = v[0:4], v[4:8], v[8:12], v[12:16]
        bd, cd, dd = diag[0:4], diag[4:8], diag[8:12]
        for r in range(7):
            mr = m[16 * r : 16 * r + 16]
            _g(a, b, c, d, mr[0:4], mr[4:8], tmp)
            torch.index_select(v, 0, k.diagonal, out=diag)
            _g(a, bd, cd, dd, mr[8:12], mr[12:16], tmp)
            v.index_copy_(0, k.diagonal, diag)
        torch.bitwise_xor(v[0:8], v[8:16], out=cv)


def _chunk_cvs(
    words: torch.Tensor, first_chunk: int, *, n_blocks: int, last_len: int, root: bool, comp: _Compressor
) -> torch.Tensor:
    """Chaining values [8, n] of n chunks (int32 words [16 blocks, 16 words, n]; chunk i has counter
    first_chunk + i), each of `n_blocks` blocks, the last `last_len` bytes long (zero-padded); `root`
    for a lone chunk."""
    n = words.shape[2]
    device = words.device
    cv = comp.k.iv.expand(8, n).clone()
    counters = torch.arange(first_chunk, first_chunk + n, dtype=torch.int64, device=device)
    d_init = torch.empty((4, n), dtype=torch.int32, device=device)
    d_init[0] = (counters & 0xFFFFFFFF).to(torch.int32)  # int64 -> int32 keeps the low 32 bits
    d_init[1] = (counters >> 32).to(torch.int32)
    for i in range(n_blocks):
        last = i == n_blocks - 1
        flags = (CHUNK_START if i == 0 else 0) | (CHUNK_END | (ROOT if root else 0) if last else 0)
        d_init[2] = last_len if last else BLOCK_LEN
        d_init[3] = flags
        comp.compress_(cv, words[i], d_init)
    return cv


def _words(data: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """`data` (uint8, n_chunks KiB) as lane-major int32 words [16 blocks, 16 words, n_chunks]: the
    one copy of the input (a transpose, so that every later operand is a set of contiguous rows)."""
    if data.data_ptr() % 4:
        data = data.clone()
    return data.view(torch.int32).view(n_chunks, 16, 16).permute(1, 2, 0).contiguous()


KERNELS = ("torch", "triton")


def kernel_setting() -> str:
    """$RFORK_BLAKE3_KERNEL: `torch` (the default: torch ops, checked here on CPU) or `triton` (one fused
    kernel per level, rfork.weights.blake3_triton; opt-in until checked on a GPU)."""
    chosen = os.environ.get("RFORK_BLAKE3_KERNEL") or "torch"
    if chosen not in KERNELS:
        raise ValueError(f"RFORK_BLAKE3_KERNEL: {chosen!r} is not one of {', '.join(KERNELS)}")
    return chosen


def blake3_hex(data: torch.Tensor, *, chunks_per_pass: int | None = None, kernel: str | None = None) -> str:
    """BLAKE3 (64 hex digits) of a flat uint8 tensor, computed on its device; equal to
    `blake3.blake3(bytes).hexdigest()`. Only the 32-byte result is copied to the host. `kernel`:
    "torch" or "triton" (default kernel_setting())."""
    if data.dim() != 1 or data.dtype != torch.uint8:
        raise ValueError(f"blake3_hex: a flat uint8 tensor, not {data.dtype}{list(data.shape)}")
    if (kernel or kernel_setting()) == "triton":
        return _blake3_triton(data)
    device = data.device
    nbytes = data.numel()
    n_full = nbytes // CHUNK_LEN
    tail = nbytes - n_full * CHUNK_LEN
    n_chunks = n_full + (1 if tail or n_full == 0 else 0)
    per_pass = chunks_per_pass or (CUDA_CHUNKS_PER_PASS if device.type == "cuda" else CPU_CHUNKS_PER_PASS)
    comp = _Compressor(max(1, min(per_pass, n_chunks)), device)
    cvs = torch.empty((8, n_chunks), dtype=torch.int32, device=device)
    for start in range(0, n_full, per_pass):
        stop = min(start + per_pass, n_full)
        words = _words(data[start * CHUNK_LEN : stop * CHUNK_LEN], stop - start)
        cvs[:, start:stop] = _chunk_cvs(
            words, start, n_blocks=16, last_len=BLOCK_LEN, root=n_chunks == 1, comp=comp
        )
    if n_chunks > n_full:  # a partial last chunk, or the empty input's one empty chunk
        padded = torch.zeros(CHUNK_LEN, dtype=torch.uint8, device=device)
        padded[:tail] = data[n_full * CHUNK_LEN :]
        n_blocks = max(1, -(-tail // BLOCK_LEN))
        cvs[:, n_full:] = _chunk_cvs(
            _words(padded, 1),
            n_full,
            n_blocks=n_blocks,
            last_len=tail - (n_blocks - 1) * BLOCK_LEN,
            root=n_chunks == 1,
            comp=comp,
        )
    while cvs.shape[1] > 1:
        n = cvs.shape[1]
        half = n // 2
        d_init = torch.tensor(
            [0, 0, BLOCK_LEN, PARENT | (ROOT if n == 2 else 0)], dtype=torch.int32, device=device
        ).reshape(4, 1)
        parents = torch.empty((8, half + n % 2), dtype=torch.int32, device=device)
        for lo in range(0, half, comp.cols):
            hi = min(lo + comp.cols, half)
            block = torch.cat([cvs[:, 2 * lo : 2 * hi : 2], cvs[:, 2 * lo + 1 : 2 * hi : 2]])  # left || right
            out = parents[:, lo:hi]
            out.copy_(comp.k.iv.expand(8, hi - lo))
            comp.compress_(out, block, d_init)
        if n % 2:
            parents[:, half] = cvs[:, n - 1]  # an odd last node moves up unchanged
        cvs = parents
    root = cvs[:, 0].cpu().numpy().astype("<u4").tobytes()  # 32 bytes: the only device-to-host copy
    return root.hex()


def _blake3_triton(data: torch.Tensor) -> str:
    """blake3_hex with the chunks and every tree level compressed by one Triton kernel launch each
    (item-major chaining values [n, 8], so a level's pairs are contiguous 16-word blocks)."""
    # triton is optional: its module is imported only when the kernel is asked for
    from rfork.weights import blake3_triton as bt

    device = data.device
    nbytes = data.numel()
    n_full = nbytes // CHUNK_LEN
    tail = nbytes - n_full * CHUNK_LEN
    n_chunks = n_full + (1 if tail or n_full == 0 else 0)
    root = ROOT if n_chunks == 1 else 0
    parts = []
    if n_full:
        words = data[: n_full * CHUNK_LEN]
        if words.data_ptr() % 4:
            words = words.clone()
        parts.append(
            bt.compress_items(
                words.view(torch.int32),
                n_items=n_full,
                item_stride=CHUNK_LEN // 4,
                n_blocks=16,
                counter_step=1,
                base_flags=0,
                first_flags=CHUNK_START,
                last_flags=CHUNK_END | root,
            )
        )
    if n_chunks > n_full:  # the partial last chunk: a single item, through the torch ops
        padded = torch.zeros(CHUNK_LEN, dtype=torch.uint8, device=device)
        padded[:tail] = data[n_full * CHUNK_LEN :]
        n_blocks = max(1, -(-tail // BLOCK_LEN))
        comp = _Compressor(1, device)
        cv = _chunk_cvs(
            _words(padded, 1),
            n_full,
            n_blocks=n_blocks,
            last_len=tail - (n_blocks - 1) * BLOCK_LEN,
            root=n_chunks == 1,
            comp=comp,
        )
        parts.append(cv.t().contiguous())
    cvs = torch.cat(parts) if len(parts) > 1 else parts[0]
    while cvs.shape[0] > 1:
        n = cvs.shape[0]
        parents = bt.compress_items(
            cvs,
            n_items=n // 2,
            item_stride=16,
            n_blocks=1,
            counter_step=0,
            base_flags=PARENT,
            first_flags=0,
            last_flags=ROOT if n == 2 else 0,
        )
        cvs = torch.cat([parents, cvs[n - 1 :]]) if n % 2 else parents
    return cvs[0].cpu().numpy().astype("<u4").tobytes().hex()
