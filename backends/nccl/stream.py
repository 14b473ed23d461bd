"""Two-sided fallback transport on torch.distributed: stream a rank's tensors from a seed to a loader.

Used when seed and loader share no one-sided provider. Phase 1 builds a two-member process group
(seed = rank 0, loader = rank 1) over a TCP rendezvous store on a port the seed opens per session;
phase 2 streams the tensors in manifest order (zero-byte tensors skipped) packed into large flat
uint8 buckets, several in flight. CUDA tensors use ``nccl``, CPU tensors ``gloo``, same code.

Why process-group *objects* and not ``init_process_group``: torch.distributed's default group is
one per process, so a seed serving several loaders at once cannot use it. Instead every session
builds its own ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` directly from its own ``TCPStore`` (own
port from the OS, own key prefix). Several such groups coexist in one process on torch 2.13 and
a peer's death fails only that group's work (gloo: "Connection closed by peer") without touching
the others. The store listens on a socket we bind ourselves (``master_listen_fd``), so it never
listens on more than the one address we chose.

Wire protocol (tags are for gloo; nccl ignores them and relies on posting order):
  tag 0  seed -> loader  int64[6] header: magic, version, tensor count, total bytes, plan digest,
                         bucket bytes (the loader plans with the seed's bucket size)
  tag 1  loader -> seed  int64[1] ack: 1 = plans agree, 0 = mismatch (both sides then fail)
  tag 2+i seed -> loader bucket i (uint8)
  tag 2+n loader -> seed int64[1] done: bytes received
Every wait is bounded by ``timeout_s`` (a stall detector: no progress for that long fails).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import PrefixStore, Store, TCPStore

from backends.errors import TransferError

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 << 20
# what a receiver accepts from the seed's header: a bucket is one gloo/NCCL message and each planned
# bucket a Python object, so a seed announcing 1-byte buckets would make a million of them per MiB
MIN_BUCKET_BYTES = 64 << 10
MAX_BUCKET_BYTES = 1 << 30
MAX_BUCKETS = 1 << 18
DEFAULT_MAX_IN_FLIGHT = 3
_MAGIC = 0x52464F524B4E4343  # "RFORKNCC"
_VERSION = 1
_TAG_HEADER = 0
_TAG_ACK = 1
_TAG_FIRST_BUCKET = 2
_SEED_RANK = 0
_LOADER_RANK = 1

BucketCallback = Callable[[int, int], None]
"""Called after each bucket with (bucket index, bytes moved so far); for progress and tests."""


class NcclTransferError(TransferError):
    """Base of every error of the NCCL/gloo fallback (a ``backends.TransferError``); names peer and phase."""


class NcclSetupError(NcclTransferError):
    """Rendezvous or process-group creation failed (peer absent, port unreachable, bad backend)."""


class NcclTimeoutError(NcclTransferError):
    """A phase made no progress within the timeout."""


class NcclPeerError(NcclTransferError):
    """The peer closed the connection or crashed mid-stream."""


class NcclPlanMismatchError(NcclTransferError):
    """Seed and loader disagree on the tensor list (count, sizes, dtypes or order)."""


@dataclass(frozen=True)
class BucketItem:
    """One tensor's bytes inside a bucket: tensor index in the full list, offset in the bucket."""

    tensor_index: int
    offset: int
    nbytes: int
    src_offset: int = 0
    """Where this piece starts inside the tensor (non-zero only for chunks of a large tensor)."""


@dataclass(frozen=True)
class Bucket:
    """A flat message. ``direct`` buckets are a ``bucket_bytes`` slice of one large tensor, sent in place."""

    items: tuple[BucketItem, ...]
    nbytes: int
    direct: bool


def bucket_bytes_refusal(bucket_bytes: int, total: int) -> str | None:
    """Why a peer's announced ``bucket_bytes`` is refused for ``total`` payload bytes, or None.

    Checked by the receiver before it plans (or allocates) anything from the peer's header: within
    [MIN_BUCKET_BYTES, MAX_BUCKET_BYTES], and at most MAX_BUCKETS buckets for the whole payload.
    """
    if not MIN_BUCKET_BYTES <= bucket_bytes <= MAX_BUCKET_BYTES:
        return f"bucket_bytes {bucket_bytes} is outside [{MIN_BUCKET_BYTES}, {MAX_BUCKET_BYTES}]"
    if -(-total // bucket_bytes) > MAX_BUCKETS:
        return f"bucket_bytes {bucket_bytes} would cut {total} bytes into more than {MAX_BUCKETS} buckets"
    return None


def plan_buckets(nbytes: Sequence[int], bucket_bytes: int) -> list[Bucket]:
    """Split tensors (by byte size, manifest order) into buckets; zero-byte tensors are skipped.

    Tensors of ``bucket_bytes`` or more travel without packing, cut into ``bucket_bytes`` slices so
    that several are in flight; smaller ones are packed in order until the next would overflow the
    bucket. Both sides derive the same plan from the sizes.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[Bucket] = []
    current: list[BucketItem] = []
    filled = 0
    for index, size in enumerate(nbytes):
        if size < 0:
            raise ValueError(f"tensor {index} has negative size {size}")
        if size == 0:
            continue
        if size >= bucket_bytes:
            if current:
                buckets.append(Bucket(tuple(current), filled, direct=False))
                current, filled = [], 0
            for start in range(0, size, bucket_bytes):
                piece = min(bucket_bytes, size - start)
                buckets.append(Bucket((BucketItem(index, 0, piece, start),), piece, direct=True))
            continue
        if filled + size > bucket_bytes:
            buckets.append(Bucket(tuple(current), filled, direct=False))
            current, filled = [], 0
        current.append(BucketItem(index, filled, size))
        filled += size
    if current:
        buckets.append(Bucket(tuple(current), filled, direct=False))
    return buckets


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor occupies on the wire."""
    return int(tensor.numel()) * int(tensor.element_size())


def plan_digest(tensors: Sequence[torch.Tensor]) -> int:
    """A 62-bit digest of (dtype, nbytes) in order, zero-byte tensors excluded, so both sides can agree."""
    h = hashlib.sha256()
    for t in tensors:
        size = tensor_nbytes(t)
        if size:
            h.update(f"{str(t.dtype).removeprefix('torch.')}:{size};".encode())
    return int.from_bytes(h.digest()[:8], "little") >> 2


def backend_for(tensors: Sequence[torch.Tensor]) -> str:
    """``nccl`` when the (non-empty) tensors are on CUDA, ``gloo`` when on CPU; mixed devices are refused."""
    kinds = {t.device.type for t in tensors if tensor_nbytes(t)}
    if not kinds or kinds == {"cpu"}:
        return "gloo"
    if kinds == {"cuda"}:
        return "nccl"
    raise NcclSetupError(f"tensors on mixed or unsupported devices {sorted(kinds)}; need all cpu or all cuda")


def local_address_towards(host: str) -> str:
    """The local IP address that routes to ``host`` (no packet is sent); loopback for loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _classify(exc: RuntimeError, *, peer: str, phase: str,
              default: type[NcclTransferError] = NcclTransferError) -> NcclTransferError:
    """Map a torch.distributed RuntimeError to our hierarchy with a message naming peer and phase."""
    msg = _first_line(exc)
    low = msg.lower()
    text = f"{phase} with {peer} failed: {msg}"
    if "timed out" in low or "timeout" in low:
        return NcclTimeoutError(text)
    if any(s in low for s in ("closed", "reset", "broken pipe", "crash", "refused", "eof")):
        return NcclPeerError(text)
    return default(text)


def _timedelta(timeout_s: float) -> dt.timedelta:
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    return dt.timedelta(seconds=timeout_s)


class Rendezvous:
    """The seed's per-session TCP store: listens on ``host``:OS-chosen port until closed.

    One per session, so ports and key spaces never collide between concurrent loaders.
    """

    def __init__(self, *, host: str, timeout_s: float) -> None:
        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind((host, 0))
            self._sock.listen(16)
            self.port = int(self._sock.getsockname()[1])
            self.store: Store | None = TCPStore(
                host, self.port, None, True, _timedelta(timeout_s),
                wait_for_workers=False, master_listen_fd=self._sock.fileno(),
            )
        except (OSError, RuntimeError) as exc:
            self._sock.close()
            raise NcclSetupError(f"cannot open rendezvous on {host}: {_first_line(exc)}") from exc
        self._sock.detach()  # the store server owns the listening fd now and closes it when freed

    def close(self) -> None:
        """Drop our reference to the store server; it stops and frees the port once the group is gone."""
        self.store = None


def connect_rendezvous(host: str, port: int, *, timeout_s: float) -> Store:
    """Connect to a seed's rendezvous store (loader side)."""
    try:
        return TCPStore(host, port, None, False, _timedelta(timeout_s))
    except RuntimeError as exc:
        raise NcclSetupError(f"rendezvous with seed {host}:{port} failed: {_first_line(exc)}") from exc


def _make_group(store: Store, *, session_id: str, rank: int, backend: str, local_host: str,
                timeout_s: float, peer: str) -> Any:
    """Build a two-member process-group object (not the process-global default group)."""
    prefixed = PrefixStore(f"rfork/nccl/{session_id}/", store)
    try:
        if backend == "gloo":
            pg_gloo = torch.distributed.ProcessGroupGloo
            opts = pg_gloo._Options()  # type: ignore[attr-defined]
            opts._devices = [pg_gloo.create_device(hostname=local_host)]
            opts._timeout = _timedelta(timeout_s)
            opts._threads = 2
            return pg_gloo(prefixed, rank, 2, opts)
        if backend == "nccl":
            pg_nccl = getattr(torch.distributed, "ProcessGroupNCCL", None)
            if pg_nccl is None or not torch.cuda.is_available():
                raise NcclSetupError("backend nccl needs CUDA and a torch build with NCCL")
            nopts = pg_nccl.Options()
            nopts._timeout = _timedelta(timeout_s)
            return pg_nccl(prefixed, rank, 2, nopts)
    except RuntimeError as exc:
        raise _classify(exc, peer=peer, phase=f"group setup (session {session_id}, backend {backend})",
                        default=NcclSetupError) from exc
    raise NcclSetupError(f"unknown backend {backend!r}; expected 'gloo' or 'nccl'")


def _shutdown_group(pg: Any) -> None:
    """Release a group's sockets promptly; never raises (the group may already be broken)."""
    for name in ("abort", "shutdown"):
        fn = getattr(pg, name, None)
        if fn is not None:
            with contextlib.suppress(RuntimeError):
                fn()
            return


def _wait(work: Any, *, timeout_s: float, peer: str, phase: str) -> None:
    try:
        ok = work.wait(_timedelta(timeout_s))
    except RuntimeError as exc:
        raise _classify(exc, peer=peer, phase=phase) from exc
    if ok is False:
        raise NcclTimeoutError(f"{phase} with {peer} made no progress in {timeout_s:.1f}s")


def _start(pg: Any, op: str, buf: torch.Tensor, peer_rank: int, tag: int, *, peer: str, phase: str) -> Any:
    """Post a send or recv; posting itself fails at once when the peer's connection is already gone."""
    try:
        return getattr(pg, op)([buf], peer_rank, tag)
    except RuntimeError as exc:
        raise _classify(exc, peer=peer, phase=phase) from exc


def _exchange(pg: Any, op: str, buf: torch.Tensor, peer_rank: int, tag: int, *, timeout_s: float, peer: str,
              phase: str) -> None:
    """Post one small message and wait for it, bounded by ``timeout_s``."""
    work = _start(pg, op, buf, peer_rank, tag, peer=peer, phase=phase)
    _wait(work, timeout_s=timeout_s, peer=peer, phase=phase)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_of(tensors: Sequence[torch.Tensor]) -> torch.device:
    for t in tensors:
        if tensor_nbytes(t):
            return t.device
    return torch.device("cpu")


def send_tensors(store: Store, tensors: Sequence[torch.Tensor], *, session_id: str, local_host: str,
                 timeout_s: float, peer: str = "loader", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, on_bucket: BucketCallback | None = None) -> int:
    """Seed side (rank 0): join the session's group and stream ``tensors``; returns bytes sent.

    Blocks the calling thread (run it on a worker); the GIL is released while gloo moves data.
    Raises NcclTransferError subclasses; never hangs longer than ``timeout_s`` per phase.
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    backend = backend_for(tensors)
    device = _device_of(tensors)
    sizes = [tensor_nbytes(t) for t in tensors]
    plan = plan_buckets(sizes, bucket_bytes)
    total = sum(sizes)
    t0 = time.perf_counter()
    pg = _make_group(store, session_id=session_id, rank=_SEED_RANK, backend=backend,
                     local_host=local_host, timeout_s=timeout_s, peer=peer)
    try:
        logger.debug("session %s: group up in %.3fs", session_id, time.perf_counter() - t0)
        header = torch.tensor([_MAGIC, _VERSION, sum(1 for s in sizes if s), total, plan_digest(tensors),
                               bucket_bytes], dtype=torch.int64, device=device)
        _exchange(pg, "send", header, _LOADER_RANK, _TAG_HEADER, timeout_s=timeout_s, peer=peer,
                  phase="header send")
        ack = torch.zeros(1, dtype=torch.int64, device=device)
        _exchange(pg, "recv", ack, _LOADER_RANK, _TAG_ACK, timeout_s=timeout_s, peer=peer,
                  phase="header ack")
        if int(ack.item()) != 1:
            raise NcclPlanMismatchError(
                f"{peer} rejected the tensor plan of session {session_id} "
                f"({len(plan)} buckets, {total} bytes): its destination tensors differ")
        staging: dict[int, torch.Tensor] = {}
        pending: deque[Any] = deque()
        moved = 0
        for i, bucket in enumerate(plan):
            if len(pending) >= max_in_flight:
                _wait(pending.popleft(), timeout_s=timeout_s, peer=peer,
                      phase=f"bucket {i - max_in_flight} send")
            if bucket.direct:
                item = bucket.items[0]
                src = tensors[item.tensor_index]
                whole = _byte_view(src if src.is_contiguous() else src.contiguous())
                buf = whole[item.src_offset: item.src_offset + item.nbytes]
            else:
                slot = i % max_in_flight
                if slot not in staging:
                    staging[slot] = torch.empty(min(bucket_bytes, total), dtype=torch.uint8, device=device)
                buf = staging[slot][: bucket.nbytes]
                for item in bucket.items:
                    buf[item.offset: item.offset + item.nbytes].copy_(_byte_view(tensors[item.tensor_index]))
                _sync(device)
            pending.append(_start(pg, "send", buf, _LOADER_RANK, _TAG_FIRST_BUCKET + i, peer=peer,
                                  phase=f"bucket {i} send"))
            moved += bucket.nbytes
            if on_bucket is not None:
                on_bucket(i, moved)
        while pending:
            _wait(pending.popleft(), timeout_s=timeout_s, peer=peer, phase="final bucket send")
        done = torch.zeros(1, dtype=torch.int64, device=device)
        _exchange(pg, "recv", done, _LOADER_RANK, _TAG_FIRST_BUCKET + len(plan),
                  timeout_s=timeout_s, peer=peer, phase="completion ack")
        if int(done.item()) != total:
            raise NcclTransferError(f"{peer} acknowledged {int(done.item())} of {total} bytes")
        logger.debug("session %s: sent %d bytes in %.3fs", session_id, total, time.perf_counter() - t0)
        return total
    finally:
        _shutdown_group(pg)


def recv_tensors(store: Store, dest_tensors: Sequence[torch.Tensor], *, session_id: str, local_host: str,
                 timeout_s: float, peer: str = "seed", max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 on_bucket: BucketCallback | None = None, timings: dict[str, float] | None = None) -> int:
    """Loader side (rank 1): join the session's group and fill ``dest_tensors`` in place; returns bytes.

    The destination tensors must match the seed's list (order, dtypes, sizes; zero-byte ones are
    ignored); a mismatch is detected from the header before any payload moves. ``timings``, when
    given, receives ``setup_s`` (group creation) and ``stream_s`` (header to completion ack).
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    backend = backend_for(dest_tensors)
    device = _device_of(dest_tensors)
    sizes = [tensor_nbytes(t) for t in dest_tensors]
    total = sum(sizes)
    t0 = time.perf_counter()
    pg = _make_group(store, session_id=session_id, rank=_LOADER_RANK, backend=backend,
                     local_host=local_host, timeout_s=timeout_s, peer=peer)
    t1 = time.perf_counter()
    try:
        header = torch.zeros(6, dtype=torch.int64, device=device)
        _exchange(pg, "recv", header, _SEED_RANK, _TAG_HEADER, timeout_s=timeout_s, peer=peer,
                  phase="header receive")
        magic, version, count, their_total, digest, bucket_bytes = (int(v) for v in header.tolist())
        mine = (_MAGIC, _VERSION, sum(1 for s in sizes if s), total, plan_digest(dest_tensors))
        refused = bucket_bytes_refusal(bucket_bytes, total)
        agree = (magic, version, count, their_total, digest) == mine and refused is None
        ack = torch.tensor([1 if agree else 0], dtype=torch.int64, device=device)
        _exchange(pg, "send", ack, _SEED_RANK, _TAG_ACK, timeout_s=timeout_s, peer=peer,
                  phase="header ack")
        if refused is not None:
            raise NcclPlanMismatchError(f"{peer} announced {refused} in session {session_id}")
        if not agree:
            raise NcclPlanMismatchError(
                f"{peer} offers {count} tensors / {their_total} bytes, destination has {mine[2]} / {total} "
                f"(digest {'equal' if digest == mine[4] else 'differs'}) in session {session_id}")
        plan = plan_buckets(sizes, bucket_bytes)
        staging: dict[int, torch.Tensor] = {}
        posted: deque[tuple[int, Any, torch.Tensor]] = deque()

        def post(i: int) -> None:
            bucket = plan[i]
            first = bucket.items[0]
            dest = dest_tensors[first.tensor_index]
            if bucket.direct and dest.is_contiguous():
                buf = _byte_view(dest)[first.src_offset: first.src_offset + first.nbytes]
            else:
                slot = i % max_in_flight
                if slot not in staging:
                    staging[slot] = torch.empty(max(b.nbytes for b in plan), dtype=torch.uint8, device=device)
                buf = staging[slot][: bucket.nbytes]
            work = _start(pg, "recv", buf, _SEED_RANK, _TAG_FIRST_BUCKET + i, peer=peer,
                          phase=f"bucket {i} receive")
            posted.append((i, work, buf))

        noncontig: dict[int, list[torch.Tensor]] = {}  # pieces of non-contiguous destinations, in order
        next_post = 0
        moved = 0
        while next_post < min(max_in_flight, len(plan)):
            post(next_post)
            next_post += 1
        while posted:
            i, work, buf = posted.popleft()
            _wait(work, timeout_s=timeout_s, peer=peer, phase=f"bucket {i} receive")
            bucket = plan[i]
            for item in bucket.items:
                dest = dest_tensors[item.tensor_index]
                chunk = buf[item.offset: item.offset + item.nbytes]
                if dest.is_contiguous():
                    view = _byte_view(dest)[item.src_offset: item.src_offset + item.nbytes]
                    if view.data_ptr() != chunk.data_ptr():
                        view.copy_(chunk)
                else:
                    pieces = noncontig.setdefault(item.tensor_index, [])
                    pieces.append(chunk.clone())
                    if sum(int(p.numel()) for p in pieces) == tensor_nbytes(dest):
                        whole = torch.cat(noncontig.pop(item.tensor_index))
                        dest.copy_(whole.view(dest.dtype).reshape(dest.shape))
            _sync(device)
            moved += bucket.nbytes
            if on_bucket is not None:
                on_bucket(i, moved)
            if next_post < len(plan):
                post(next_post)
                next_post += 1
        done = torch.tensor([moved], dtype=torch.int64, device=device)
        _exchange(pg, "send", done, _SEED_RANK, _TAG_FIRST_BUCKET + len(plan),
                  timeout_s=timeout_s, peer=peer, phase="completion ack")
        if timings is not None:
            timings["setup_s"] = t1 - t0
            timings["stream_s"] = time.perf_counter() - t1
        return moved
    finally:
        _shutdown_group(pg)
