"""Per-tensor weight digests: xxh3-128 for host tensors, pwsum64 on the GPU.

Host (CPU) tensors use `xxh3-128` (the xxHash library's XXH3 128-bit hash of the tensor's raw bytes,
32 hex digits). It is non-linear (no combination of changed words cancels out, unlike a sum) and runs
at memory speed; `StreamingDigest` computes the same value chunk by chunk as the bytes arrive, so
the loader hashes each chunk while it is still in cache.

CUDA tensors keep a device-side digest so no weight byte crosses to the host:
Algorithm `pwsum64-v1`: the tensor's bytes are read as little-endian 64-bit words w_0 .. w_{n-1}
(a final partial word is zero-padded). The digest is the pair

    A = sum_i w_i * (i + 1)   mod 2**64      (position-weighted: catches swapped or shifted words)
    B = sum_i w_i             mod 2**64      (plain sum: any single changed word changes it)

written as 32 hex digits (A then B, each 16 digits). Integer addition and multiplication modulo
2**64 are associative and commutative, so the reduction order (CPU vector lanes, CUDA blocks) does
not change the result. Words are processed in chunks that stay in cache; within chunk c (of CHUNK
words) the weight of word j is c*CHUNK + j + 1, so A_c = sum_j w_j (j+1) + c*CHUNK*B_c. The weights
and accumulators live on the tensor's device: no weight byte is copied to the host.
"""

from __future__ import annotations

import ctypes
import threading

import torch
import xxhash

PWSUM64 = "pwsum64-v1"
XXH3_128 = "xxh3-128"
ALGORITHMS = (XXH3_128, PWSUM64)
CHUNK_WORDS = 1 << 15  # 256 KiB of data per chunk: data + product stay in L2 (measured best here)
_MASK = (1 << 64) - 1

_weights_lock = threading.Lock()
_weights: dict[torch.device, torch.Tensor] = {}


def _chunk_weights(device: torch.device) -> torch.Tensor:
    with _weights_lock:
        w = _weights.get(device)
        if w is None:
            w = torch.arange(1, CHUNK_WORDS + 1, dtype=torch.int64, device=device)
            _weights[device] = w
        return w


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the tensor's bytes (a same-device copy only if it is not contiguous)."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    t = t.reshape(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def checksum_bytes(data: torch.Tensor) -> str:
    """Digest of a flat uint8 tensor (see the module doc); returns 32 hex digits."""
    n = data.numel()
    device = data.device
    if n == 0:
        return "0" * 32
    n_words = n // 8
    acc_a = torch.zeros((), dtype=torch.int64, device=device)
    acc_b = torch.zeros((), dtype=torch.int64, device=device)
    if n_words:
        body = data[: n_words * 8]
        if body.data_ptr() % 8:
            body = body.clone()  # int64 views need 8-byte alignment
        words = body.view(torch.int64)
        if device.type == "cpu" and n_words >= CHUNK_WORDS:
            # Few large ops instead of a Python loop per 256 KiB chunk: over [chunks, CHUNK_WORDS], one
            # int64 matrix-vector product and one row sum give every chunk's (sum w_j (j+1), sum w_j).
            # Far fewer GIL round trips: matters while a transport progress thread also runs Python.
            full = n_words // CHUNK_WORDS
            mat = words[: full * CHUNK_WORDS].view(full, CHUNK_WORDS)
            a_c = torch.mv(mat, _chunk_weights(device))  # per chunk: sum w_j (j+1)
            b_c = mat.sum(dim=1)  # per chunk: sum w_j
            base = torch.arange(full, dtype=torch.int64, device=device) * CHUNK_WORDS
            acc_a += (a_c + base * b_c).sum()
            acc_b += b_c.sum()
            rest = words[full * CHUNK_WORDS :]
            if rest.numel():
                s_b = rest.sum()
                acc_a += (rest * _chunk_weights(device)[: rest.numel()]).sum() + s_b * (full * CHUNK_WORDS)
                acc_b += s_b
            words = words[:0]
        weights = _chunk_weights(device)
        tmp = torch.empty(CHUNK_WORDS, dtype=torch.int64, device=device)
        for c, start in enumerate(range(0, n_words, CHUNK_WORDS)):
            chunk = words[start : start + CHUNK_WORDS]
            m = chunk.numel()
            prod = torch.mul(chunk, weights[:m], out=tmp[:m])
            s_b = chunk.sum()
            acc_a += prod.sum()
            if c:
                acc_a += s_b * (c * CHUNK_WORDS)
            acc_b += s_b
    tail = data[n_words * 8 :]
    if tail.numel():
        shifts = torch.arange(tail.numel(), dtype=torch.int64, device=device) * 8
        word = (tail.to(torch.int64) << shifts).sum()
        acc_a += word * (n_words + 1)
        acc_b += word
    a = int(acc_a.item()) & _MASK
    b = int(acc_b.item()) & _MASK
    return f"{a:016x}{b:016x}"


def algorithm_for(device: torch.device | str) -> str:
    """The digest used for tensors on `device`: xxh3-128 on the host, pwsum64 on a GPU."""
    return PWSUM64 if torch.device(device).type == "cuda" else XXH3_128


def tensor_checksum(tensor: torch.Tensor) -> str:
    """Digest of a tensor's raw bytes under algorithm_for(tensor.device) (32 hex digits)."""
    if algorithm_for(tensor.device) == XXH3_128:
        return xxh3_bytes(_as_bytes(tensor))
    return checksum_bytes(_as_bytes(tensor))


def xxh3_bytes(data: torch.Tensor) -> str:
    """xxh3-128 of a flat uint8 host tensor (zero-copy: hashed where it lies)."""
    if data.numel() == 0:
        return xxhash.xxh3_128_hexdigest(b"")
    return xxhash.xxh3_128_hexdigest(_host_view(int(data.data_ptr()), data.numel()))


_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.restype = ctypes.py_object
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_READ = 0x100


def _host_view(ptr: int, nbytes: int) -> memoryview:
    """A read-only memoryview of host memory [ptr, +nbytes) without copying (the caller keeps the
    memory alive while the view is used)."""
    view: memoryview = _memory_view(ptr, nbytes, _PYBUF_READ)
    return view


class StreamingDigest:
    """xxh3-128 of one host tensor's bytes fed in order, chunk by chunk, as they land.

    `update(ptr, n)` hashes host memory [ptr, +n); the bytes must arrive in address order and add
    up to the tensor. Not thread-safe: one feeder (the loader's verifier thread).
    """

    __slots__ = ("_hasher", "fed")

    def __init__(self) -> None:
        self._hasher = xxhash.xxh3_128()
        self.fed = 0

    def update(self, ptr: int, nbytes: int) -> None:
        if nbytes:
            self._hasher.update(_host_view(ptr, nbytes))
            self.fed += nbytes

    def hexdigest(self) -> str:
        return str(self._hasher.hexdigest())


def reference_checksum(raw: bytes) -> str:
    """Pure-Python reference of the same algorithm, for tests (slow; small inputs only)."""
    a = b = 0
    padded = raw + b"\0" * (-len(raw) % 8)
    for i in range(0, len(padded), 8):
        w = int.from_bytes(padded[i : i + 8], "little")
        a = (a + w * (i // 8 + 1)) & _MASK
        b = (b + w) & _MASK
    return f"{a:016x}{b:016x}" if raw else "0" * 32
