"""A paged KV pool: its geometry, its registration, and the spans that move one layer's pages.

A pool is one registered buffer of `layers x (K, V) x pages x page_bytes`: page p of layer l, half
kv (0 = K, 1 = V) starts at byte ((l * 2 + kv) * pages + p) * page_bytes. It is registered once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backends.descriptor import MemoryRegionDescriptor
from backends.engine import Region, TransferEngine
from backends.errors import TransferError
from backends.spans import page_spans

MAX_LAYERS = 4095


class KvError(TransferError):
    """A KV request or handshake failed; the message names the request and the peer."""


@dataclass(frozen=True, slots=True)
class KvGeometry:
    """Shape of a paged pool in bytes: layers x (K, V) x pages x page_bytes."""

    layers: int
    pages: int
    page_bytes: int

    def __post_init__(self) -> None:
        if not 0 < self.layers <= MAX_LAYERS:
            raise ValueError(f"layers must be in 1..{MAX_LAYERS}, not {self.layers}")
        if self.pages <= 0 or self.page_bytes <= 0:
            raise ValueError(f"pages and page_bytes must be positive, not {self.pages}, {self.page_bytes}")

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return self.layers * 2 * self.pages * self.page_bytes

    def offset(self, layer: int, kv: int, page: int) -> int:
        """Byte offset of page `page` of layer `layer`, half kv (0 = K, 1 = V)."""
        return ((layer * 2 + kv) * self.pages + page) * self.page_bytes

    def check_pages(self, pages: Sequence[int], what: str) -> list[int]:
        """The pages as ints; KvError naming `what` when one is out of range."""
        out = [int(p) for p in pages]
        bad = [p for p in out if not 0 <= p < self.pages]
        if bad:
            raise KvError(f"{what}: page id {bad[0]} is outside 0..{self.pages - 1}")
        return out

    def to_dict(self) -> dict[str, int]:
        """JSON form for the handshake."""
        return {"layers": self.layers, "pages": self.pages, "page_bytes": self.page_bytes}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KvGeometry:
        """Inverse of to_dict; ValueError on missing or bad fields."""
        return cls(int(d["layers"]), int(d["pages"]), int(d["page_bytes"]))


class KvPool:
    """A paged KV pool registered once with an engine.

    buffer: a contiguous CPU tensor or writable buffer of exactly geometry.nbytes (e.g. the
    model's cache viewed as bytes); by default a zeroed numpy array is allocated.
    """

    def __init__(
        self,
        engine: TransferEngine,
        *,
        layers: int,
        pages: int,
        page_bytes: int,
        buffer: Any = None,
        access: str = "rw",
    ) -> None:
        self.engine = engine
        self.geometry = KvGeometry(layers, pages, page_bytes)
        if buffer is None:
            import numpy as np  # only pools without a caller's buffer need numpy

            buffer = np.zeros(self.geometry.nbytes, dtype=np.uint8)
        self.buffer = buffer
        self.region: Region = engine.register(buffer, access)
        if self.region.nbytes != self.geometry.nbytes:
            nbytes = self.region.nbytes
            self.region.close()
            raise ValueError(f"pool buffer has {nbytes} bytes, geometry needs {self.geometry.nbytes}")

    @property
    def descriptor(self) -> MemoryRegionDescriptor:
        """What peers need to write into this pool."""
        return self.region.descriptor

    def close(self) -> None:
        """Deregister the pool (no transfer may still be running on it)."""
        self.region.close()


def layer_spans(
    src: KvGeometry, src_pages: Sequence[int], dst: KvGeometry, dst_pages: Sequence[int], layer: int
) -> list[tuple[int, int, int]]:
    """(src_offset, dst_offset, length) for layer's K and V pages, merging pages adjacent on both sides."""
    page = src.page_bytes
    spans: list[tuple[int, int, int]] = []
    for kv in (0, 1):
        s_base, d_base = src.offset(layer, kv, 0), dst.offset(layer, kv, 0)
        spans += page_spans(src_pages, s_base, page, dst_pages, d_base, page, page)
    return spans
