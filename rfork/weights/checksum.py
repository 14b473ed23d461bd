"""Per-tensor weight digests, chosen per threat model by `RFORK_DIGEST` (the same on every process).

- Unset (the default): host (CPU) tensors use BLAKE3 (below), CUDA tensors `pmix64-v1` (below),
  computed on the device, until the device BLAKE3's speed is measured on a GPU. A loader that must
  not trust a non-cryptographic digest sets `LoadOptions.require_crypto_digest`, and then refuses
  to pull into CUDA tensors under this setting.
- `RFORK_DIGEST=xxh3-128` (a trusted fleet, where every holder of a register token is an operator's
  own machine): it guards against accidents (bit flips, torn or misdirected reads, a stale or wrong
  checkpoint), not against a crafted collision. Host tensors use `xxh3-128` (XXH3 128-bit of the raw
  bytes, 32 hex digits), at memory speed, computed by the transport's native thread as reads land;
  CUDA tensors `pmix64-v1`. Neither is cryptographic: pmix64-v1 is a sum of per-word mixes and admits
  generalized-birthday (Wagner) collisions in seconds of CPU time.
- `RFORK_DIGEST=blake3` (hostile seeds: any holder of a register token may serve crafted bytes):
  BLAKE3 (64 hex digits) for every tensor on every device: on the host with the `blake3` package
  (multi-threaded, `RFORK_DIGEST_THREADS`, default min(4, CPUs)); on a GPU with torch ops on the
  device (rfork.weights.blake3_tensor, the same output; tensors under 1 MiB from a host copy). Every
  verification path takes its digest from here (the one-sided verifier, staged GPU reads, NCCL, a
  seed's re-verification, the manifests a loader publishes when it becomes a seed, `rfork digest`
  anchors), and a loader refuses a manifest whose algorithm is not its own, so a pmix64 or xxh3
  manifest from a seed is refused. Host and GPU digests agree, so one anchor covers both.

`StreamingDigest` computes a host digest chunk by chunk as the bytes arrive, so the loader hashes
each chunk while it is still in cache.

pmix64-v1 (it replaced `pwsum64-v1`, a position-weighted sum: linear, so a zeroed quarter of a
tensor plus two compensating words kept its digest). The tensor's bytes are read as little-endian
64-bit words w_0 .. w_{n-1} (a final partial word is zero-padded); all arithmetic is modulo 2**64 and
`>>>` is a logical shift. Each word is mixed with its position through two splitmix64-style
finalisers:

    x_i = mix(w_i XOR (i + 1) * K0, K1, K2)      mix(v, a, b) = ((v * a) ^ (.. >>> 32)) * b ^ (.. >>> 29)
    y_i = (x_i XOR K3) * K4;  y_i ^= y_i >>> 32
    digest = (sum_i x_i, sum_i y_i)  written as 32 hex digits

A change to any word changes its x_i unpredictably, so accidental changes do not cancel; but the
sums admit crafted collisions (a k-tree search over candidate word edits finds one for a 2 MiB tensor
in seconds), so pmix64-v1 is for the trusted-fleet setting only. Only elementwise integer tensor ops:
the same code runs on CPU, so it is tested here.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import blake3
import torch
import xxhash

from planner.contract import is_cryptographic as is_cryptographic  # the one list, the planner's
from rfork.weights.blake3_tensor import blake3_hex

DEVICE_DIGEST = "pmix64-v1"
XXH3_128 = "xxh3-128"
BLAKE3 = "blake3"
HOST_ALGORITHMS = (XXH3_128, BLAKE3)
ALGORITHMS = (*HOST_ALGORITHMS, DEVICE_DIGEST)
CHUNK_WORDS = 1 << 18  # 2 MiB of words per step: few torch calls per tensor, temporaries stay small
_MASK = (1 << 64) - 1


def _s64(v: int) -> int:
    """A 64-bit constant as the signed int64 torch stores."""
    v &= _MASK
    return v - (1 << 64) if v >= 1 << 63 else v


K0, K1, K2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
K3, K4 = 0xD6E8FEB86659FD93, 0xFF51AFD7ED558CCD
_LOW = {s: (1 << (64 - s)) - 1 for s in (29, 32)}

_index_lock = threading.Lock()
_index_keys: dict[torch.device, torch.Tensor] = {}


def _chunk_index_keys(device: torch.device) -> torch.Tensor:
    """(j + 1) * K0 for j in [0, CHUNK_WORDS): a chunk at word offset o adds o * K0."""
    with _index_lock:
        keys = _index_keys.get(device)
        if keys is None:
            keys = torch.arange(1, CHUNK_WORDS + 1, dtype=torch.int64, device=device) * _s64(K0)
            _index_keys[device] = keys
        return keys


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the tensor's bytes (a same-device copy only if it is not contiguous)."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    t = t.reshape(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _xorshift_(x: torch.Tensor, shift: int, tmp: torch.Tensor) -> None:
    """x ^= x >>> shift, in place (torch shifts int64 arithmetically: mask the sign's copies off)."""
    torch.bitwise_right_shift(x, shift, out=tmp)
    tmp.bitwise_and_(_LOW[shift])
    x.bitwise_xor_(tmp)


def _mix_sums(words: torch.Tensor, first_index: int, acc_x: torch.Tensor, acc_y: torch.Tensor) -> None:
    """Add sum x_i and sum y_i of `words` (int64, at word positions first_index..) to the accumulators."""
    n = words.numel()
    keys = _chunk_index_keys(words.device)
    x = torch.empty(min(n, CHUNK_WORDS), dtype=torch.int64, device=words.device)
    tmp = torch.empty_like(x)
    for start in range(0, n, CHUNK_WORDS):
        m = min(CHUNK_WORDS, n - start)
        xs, ts = x[:m], tmp[:m]
        torch.add(keys[:m], _s64((first_index + start) * K0), out=xs)  # (i + 1) * K0
        xs.bitwise_xor_(words[start : start + m])
        xs.mul_(_s64(K1))
        _xorshift_(xs, 32, ts)
        xs.mul_(_s64(K2))
        _xorshift_(xs, 29, ts)
        acc_x += xs.sum()
        xs.bitwise_xor_(_s64(K3))
        xs.mul_(_s64(K4))
        _xorshift_(xs, 32, ts)
        acc_y += xs.sum()


def checksum_bytes(data: torch.Tensor) -> str:
    """pmix64-v1 of a flat uint8 tensor on its device (see the module doc); returns 32 hex digits."""
    n = data.numel()
    device = data.device
    if n == 0:
        return "0" * 32
    n_words = n // 8
    acc_x = torch.zeros((), dtype=torch.int64, device=device)
    acc_y = torch.zeros((), dtype=torch.int64, device=device)
    if n_words:
        body = data[: n_words * 8]
        if body.data_ptr() % 8:
            body = body.clone()  # int64 views need 8-byte alignment
        _mix_sums(body.view(torch.int64), 0, acc_x, acc_y)
    tail = data[n_words * 8 :]
    if tail.numel():
        shifts = torch.arange(tail.numel(), dtype=torch.int64, device=device) * 8
        word = (tail.to(torch.int64) << shifts).sum().reshape(1)
        _mix_sums(word, n_words, acc_x, acc_y)
    a = int(acc_x.item()) & _MASK
    b = int(acc_y.item()) & _MASK
    return f"{a:016x}{b:016x}"


def host_algorithm() -> str:
    """The host digest of this process: $RFORK_DIGEST (blake3 unless set; ValueError if unknown)."""
    chosen = os.environ.get("RFORK_DIGEST") or BLAKE3
    if chosen not in HOST_ALGORITHMS:
        raise ValueError(f"RFORK_DIGEST: {chosen!r} is not one of {', '.join(HOST_ALGORITHMS)}")
    return chosen


def algorithm_for(device: torch.device | str) -> str:
    """The digest used for tensors on `device`: host_algorithm() on the host; on a GPU BLAKE3 only when
    RFORK_DIGEST=blake3 is set, else pmix64-v1 (the device BLAKE3 awaits a GPU measurement)."""
    chosen = host_algorithm()
    if torch.device(device).type != "cuda":
        return chosen
    return BLAKE3 if os.environ.get("RFORK_DIGEST") == BLAKE3 else DEVICE_DIGEST



def blake3_threads() -> int:
    """Threads for one host BLAKE3 digest: $RFORK_DIGEST_THREADS, default min(4, CPUs)."""
    raw = os.environ.get("RFORK_DIGEST_THREADS")
    if not raw:
        return min(4, os.cpu_count() or 1)
    if not raw.isascii() or not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"RFORK_DIGEST_THREADS: {raw!r} is not a positive integer")
    return int(raw)


# Device tensors smaller than this are copied to the host for BLAKE3: the torch-ops path costs about
# 6,000 kernel launches per tensor whatever its size, more than copying a small tensor out.
BLAKE3_DEVICE_MIN_BYTES = 1 << 20


def tensor_checksum(tensor: torch.Tensor, *, threads: int | None = None) -> str:
    """Digest of a tensor's raw bytes under algorithm_for(tensor.device), computed where it lies (BLAKE3
    of a device tensor under BLAKE3_DEVICE_MIN_BYTES: on a host copy); `threads` for a host BLAKE3
    (default blake3_threads(): 1 where the caller spreads many digests over threads itself)."""
    algorithm = algorithm_for(tensor.device)
    data = _as_bytes(tensor)
    if algorithm == XXH3_128:
        return xxh3_bytes(data)
    if algorithm == BLAKE3:
        if data.device.type == "cpu":
            return blake3_bytes(data, threads=threads)
        if data.numel() < BLAKE3_DEVICE_MIN_BYTES:
            return blake3_bytes(data.cpu())
        return blake3_hex(data)
    return checksum_bytes(data)


def blake3_bytes(data: torch.Tensor, *, threads: int | None = None) -> str:
    """BLAKE3 of a flat uint8 host tensor (zero-copy: hashed where it lies) on `threads` threads
    (default blake3_threads())."""
    hasher = blake3.blake3(max_threads=threads or blake3_threads())
    if data.numel():
        hasher.update(_host_view(int(data.data_ptr()), data.numel()))
    return str(hasher.hexdigest())


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
    memory alive while the view is used). ValueError for a negative length or a null pointer:
    PyMemoryView_FromMemory takes a negative length as is, and a hasher reads it as a huge one."""
    if nbytes < 0 or (nbytes and not ptr):
        raise ValueError(f"host view of {nbytes} bytes at {ptr:#x}")
    view: memoryview = _memory_view(ptr, nbytes, _PYBUF_READ)
    return view


class StreamingDigest:
    """A host digest (xxh3-128 or BLAKE3) of one tensor's bytes fed in order, chunk by chunk, as they land.

    `update(ptr, n)` hashes host memory [ptr, +n); the bytes must arrive in address order and add
    up to the tensor (ValueError for n < 0). Not thread-safe: one feeder (the loader's verifier thread).
    """

    __slots__ = ("_hasher", "fed")

    def __init__(self, algorithm: str = XXH3_128) -> None:
        if algorithm not in HOST_ALGORITHMS:
            raise ValueError(
                f"StreamingDigest: {algorithm!r} is not a host digest ({', '.join(HOST_ALGORITHMS)})"
            )
        self._hasher: Any = (
            xxhash.xxh3_128() if algorithm == XXH3_128 else blake3.blake3(max_threads=blake3_threads())
        )
        self.fed = 0

    def update(self, ptr: int, nbytes: int) -> None:
        if nbytes:
            self._hasher.update(_host_view(ptr, nbytes))
            self.fed += nbytes

    def hexdigest(self) -> str:
        return str(self._hasher.hexdigest())


def reference_checksum(raw: bytes) -> str:
    """Pure-Python reference of pmix64-v1, for tests (slow; small inputs only)."""
    if not raw:
        return "0" * 32
    a = b = 0
    padded = raw + b"\0" * (-len(raw) % 8)
    for i in range(0, len(padded), 8):
        w = int.from_bytes(padded[i : i + 8], "little")
        x = w ^ ((i // 8 + 1) * K0 & _MASK)
        x = x * K1 & _MASK
        x ^= x >> 32
        x = x * K2 & _MASK
        x ^= x >> 29
        y = (x ^ K3) * K4 & _MASK
        y ^= y >> 32
        a = (a + x) & _MASK
        b = (b + y) & _MASK
    return f"{a:016x}{b:016x}"
