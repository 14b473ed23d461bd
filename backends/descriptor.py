"""Serialisable names: an engine's address and a memory region's descriptor (wire format v1).

Both are opaque blobs to callers; the layout below only has to agree between rfork processes of
the same version. All integers little-endian.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass

from backends.errors import TransferError

_ADDR_MAGIC = b"RFEA"
_DESC_MAGIC = b"RFMR"
_VERSION = 1

ACCESS_NAMES = ("read", "write", "rw")
MEMORY_KINDS = ("host", "cuda")


@dataclass(frozen=True, slots=True)
class EngineAddress:
    """The provider name and one raw endpoint name per domain."""

    provider: str
    domains: tuple[bytes, ...]

    def to_bytes(self) -> bytes:
        """Encode as magic, version, provider, then length-prefixed domain names."""
        prov = self.provider.encode()
        out = [_ADDR_MAGIC, struct.pack("<BBH", _VERSION, len(prov), len(self.domains)), prov]
        for name in self.domains:
            out.append(struct.pack("<H", len(name)))
            out.append(name)
        return b"".join(out)

    @classmethod
    def from_bytes(cls, blob: bytes) -> EngineAddress:
        """Decode what to_bytes produced; TransferError on anything else."""
        try:
            if blob[:4] != _ADDR_MAGIC:
                raise ValueError("bad magic")  # noqa: TRY301
            version, plen, ndom = struct.unpack_from("<BBH", blob, 4)
            if version != _VERSION:
                raise ValueError(f"version {version}")  # noqa: TRY301
            pos = 8
            provider = blob[pos : pos + plen].decode()
            pos += plen
            names = []
            for _ in range(ndom):
                (n,) = struct.unpack_from("<H", blob, pos)
                pos += 2
                names.append(bytes(blob[pos : pos + n]))
                pos += n
            if pos != len(blob) or ndom == 0:
                raise ValueError("length mismatch")  # noqa: TRY301
        except (ValueError, struct.error, UnicodeDecodeError) as exc:
            raise TransferError(f"not an rfork engine address ({exc})") from exc
        return cls(provider, tuple(names))

    def hosts(self) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...]:
        """The IP addresses of the endpoints, where the names carry them; () where they do not.

        tcp names are sockaddrs (IPv4 or IPv6); shm endpoints live on this host (loopback). Other
        providers' names (efa, verbs) carry no IP address here. All or nothing: one name that is not
        a sockaddr gives ().
        """
        if self.provider == "shm":
            return (ipaddress.IPv4Address("127.0.0.1"),)
        if self.provider != "tcp":
            return ()
        out: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
        for name in self.domains:
            family = int.from_bytes(name[:2], "little")
            if family == socket.AF_INET and len(name) == 16:
                out.append(ipaddress.IPv4Address(name[4:8]))
            elif family == socket.AF_INET6 and len(name) == 28:
                out.append(ipaddress.IPv6Address(name[8:24]))
            else:
                return ()
        return tuple(out)


@dataclass(frozen=True, slots=True)
class MemoryRegionDescriptor:
    """What a peer needs to reach a registered region: owner address, keys, base, size, access.

    `base` is the address remote ops start from: the virtual address for providers that use
    FI_MR_VIRT_ADDR (shm, efa, verbs), 0 in offset mode (tcp). `memory_kind` is "host" today;
    "cuda" is reserved for device memory.
    """

    address: bytes
    keys: tuple[int, ...]
    base: int
    length: int
    access: str
    memory_kind: str = "host"

    def __post_init__(self) -> None:
        if self.access not in ACCESS_NAMES:
            raise TransferError(f"descriptor access {self.access!r} is not one of {ACCESS_NAMES}")
        if self.memory_kind not in MEMORY_KINDS:
            raise TransferError(f"descriptor memory kind {self.memory_kind!r} is not one of {MEMORY_KINDS}")

    @property
    def readable(self) -> bool:
        """Peers may read from this region."""
        return self.access in ("read", "rw")

    @property
    def writable(self) -> bool:
        """Peers may write into this region."""
        return self.access in ("write", "rw")

    def to_bytes(self) -> bytes:
        """Encode (fixed header, keys, then the owner's engine address)."""
        head = struct.pack(
            "<4sBBBHQQI",
            _DESC_MAGIC,
            _VERSION,
            ACCESS_NAMES.index(self.access),
            MEMORY_KINDS.index(self.memory_kind),
            len(self.keys),
            self.base,
            self.length,
            len(self.address),
        )
        return head + struct.pack(f"<{len(self.keys)}Q", *self.keys) + self.address

    @classmethod
    def from_bytes(cls, blob: bytes) -> MemoryRegionDescriptor:
        """Decode what to_bytes produced; TransferError on anything else."""
        fmt = "<4sBBBHQQI"
        try:
            magic, version, access, kind, nkeys, base, length, alen = struct.unpack_from(fmt, blob, 0)
            if magic != _DESC_MAGIC or version != _VERSION:
                raise ValueError("bad magic or version")  # noqa: TRY301
            pos = struct.calcsize(fmt)
            keys = struct.unpack_from(f"<{nkeys}Q", blob, pos)
            pos += 8 * nkeys
            address = bytes(blob[pos : pos + alen])
            if pos + alen != len(blob):
                raise ValueError("length mismatch")  # noqa: TRY301
            EngineAddress.from_bytes(address)
            return cls(address, tuple(keys), base, length, ACCESS_NAMES[access], MEMORY_KINDS[kind])
        except (ValueError, IndexError, struct.error) as exc:
            raise TransferError(f"not an rfork memory region descriptor ({exc})") from exc
