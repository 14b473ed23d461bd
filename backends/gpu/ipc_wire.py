"""The CUDA IPC descriptor: what a seed hands a loader so that it can open one GPU region of the seed's.

Wire format (version 3), little-endian: a fixed header (magic ``RFCI``, version, access, whether the
opener must wait on the exporter's event, the exporting backend, the exporter's device ordinal, its
pid, a random 63-bit key, the region's length and its offset inside the shared storage, the storage's
size and its offset inside the CUDA allocation, the ref-counter offset, a reserved word), then five
length-prefixed blobs: the host name, the allocation's IPC handle (the 64-byte ``cudaIpcMemHandle``
from the driver exporter; torch's own handle string from torch's, 66 bytes on torch 2.11), torch's
ref-counter handle, the exporter's IPC event handle, and the GPU's UUID.

Two exporters write it: ``torch`` (``UntypedStorage._share_cuda_``: handle, ref counter, event) and
``driver`` (cuda-python: ``cuMemGetAddressRange`` + ``cuIpcGetMemHandle``, no ref counter, no event;
the exporter synchronised before exporting). Decoding checks the shape only; the engine checks the
ranges against the loader's request (backends.gpu.cuda_ipc).
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import NamedTuple

from backends.descriptor import ACCESS_NAMES
from backends.errors import TransferError

PROVIDER = "cuda-ipc"
EXPORTERS = ("torch", "driver")
IPC_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE
_MAGIC = b"RFCI"
_VERSION = 3  # 3: the exporting backend travels (a driver export has no torch ref counter)
# magic, version, access, event_sync, exporter, device, pid, key, length, region offset,
# storage size, storage offset, ref-counter offset, reserved
_HEAD = "<4sBBBBiqQQQQQQQ"
_BLOBS = 5
_MAX_BLOB = 4096  # host names and handles are short; a larger length prefix is garbage


def host_id() -> str:
    """Names this boot of this machine: CUDA IPC handles mean nothing anywhere else."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


class IpcExport(NamedTuple):
    """One storage's export: the allocation's IPC handle, where the storage sits inside that allocation,
    and (torch exports only) torch's cross-process ref counter and the exporter's event."""

    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True, slots=True)
class CudaIpcDescriptor:
    """A region exported over CUDA IPC: where it lives (host, pid, GPU), its handles, size and access.

    ``region_offset`` is the region's first byte inside the shared storage; ``length`` its size.
    ``key`` is a random 63-bit token naming the region within its owner process. ``device`` is the
    exporter's ordinal (informational: ordinals differ under CUDA_VISIBLE_DEVICES); ``device_uuid``
    names the GPU, and the opener maps it to its own ordinal. ``exporter`` is the backend that made it.
    """

    host: str
    owner_pid: int
    key: int
    device: int
    access: str
    length: int
    region_offset: int
    ipc: IpcExport
    device_uuid: str = ""
    exporter: str = "torch"

    def __post_init__(self) -> None:
        if self.access not in ACCESS_NAMES:
            raise TransferError(f"descriptor access {self.access!r} is not one of {ACCESS_NAMES}")
        if self.exporter not in EXPORTERS:
            raise TransferError(f"descriptor exporter {self.exporter!r} is not one of {EXPORTERS}")
        if min(self.length, self.region_offset, self.ipc.storage_size, self.ipc.storage_offset) < 0:
            raise TransferError("descriptor lengths and offsets must be non-negative")

    @property
    def readable(self) -> bool:
        return self.access in ("read", "rw")

    @property
    def writable(self) -> bool:
        return self.access in ("write", "rw")

    @property
    def address(self) -> bytes:
        """The owner's address, in the sense of TransferEngine.address (host and pid)."""
        return f"{PROVIDER}:{self.host}:{self.owner_pid}".encode()

    def to_bytes(self) -> bytes:
        """Encode: fixed header, then the host name, the three handles and the UUID, length-prefixed."""
        x = self.ipc
        head = struct.pack(_HEAD, _MAGIC, _VERSION, ACCESS_NAMES.index(self.access),
                           int(x.event_sync_required), EXPORTERS.index(self.exporter), self.device,
                           self.owner_pid, self.key, self.length, self.region_offset,
                           x.storage_size, x.storage_offset, x.ref_counter_offset, 0)
        parts = [head]
        for blob in (self.host.encode(), x.handle, x.ref_counter_handle, x.event_handle,
                     self.device_uuid.encode()):
            parts += [struct.pack("<I", len(blob)), blob]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, blob: bytes) -> CudaIpcDescriptor:
        """Decode what to_bytes produced; TransferError on anything else (a peer may send anything)."""
        def bad(why: str) -> TransferError:
            return TransferError(f"not an rfork CUDA IPC descriptor ({why})")

        try:
            (magic, version, access, sync, exporter, device, pid, key, length, roff, ssize, soff, rcoff,
             _reserved) = struct.unpack_from(_HEAD, blob, 0)
        except struct.error as exc:
            raise bad(str(exc)) from exc
        if magic != _MAGIC or version != _VERSION:
            raise bad("bad magic or version")
        if access >= len(ACCESS_NAMES) or exporter >= len(EXPORTERS) or sync > 1:
            raise bad("access, exporter or event flag out of range")
        pos = struct.calcsize(_HEAD)
        fields: list[bytes] = []
        for _ in range(_BLOBS):
            if pos + 4 > len(blob):
                raise bad("truncated")
            (n,) = struct.unpack_from("<I", blob, pos)
            pos += 4
            if n > _MAX_BLOB or pos + n > len(blob):
                raise bad("truncated or oversized field")
            fields.append(bytes(blob[pos:pos + n]))
            pos += n
        if pos != len(blob):
            raise bad("length mismatch")
        # a driver export is the bare cudaIpcMemHandle; torch's is its own opaque string (torch 2.11:
        # a version and a kind byte before the 64-byte handle), which only torch opens
        if EXPORTERS[exporter] == "driver" and len(fields[1]) != IPC_HANDLE_BYTES:
            raise bad(f"IPC handle of {len(fields[1])} bytes, not {IPC_HANDLE_BYTES}")
        if not fields[1]:
            raise bad("empty IPC handle")
        try:
            host, uuid = fields[0].decode(), fields[4].decode()
        except UnicodeDecodeError as exc:
            raise bad(str(exc)) from exc
        ipc = IpcExport(fields[1], ssize, soff, fields[2], rcoff, fields[3], bool(sync))
        return cls(host, pid, key, device, ACCESS_NAMES[access], length, roff, ipc, uuid, EXPORTERS[exporter])


def as_ipc_descriptor(d: CudaIpcDescriptor | bytes) -> CudaIpcDescriptor:
    """A descriptor from itself or its bytes (TransferError on garbage)."""
    return d if isinstance(d, CudaIpcDescriptor) else CudaIpcDescriptor.from_bytes(d)
