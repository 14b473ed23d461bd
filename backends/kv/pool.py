"""A paged KV pool: its geometry, its registration, and the spans that move one layer's pages.

A pool is one registered buffer of `layers x (K, V) x pages x page_bytes`: page p of layer l, half
kv (0 = K, 1 = V) starts at byte ((l * 2 + kv) * pages + p) * page_bytes. It is registered once.
Engines that allocate each layer's cache on its own (vLLM: one `(2, blocks, ...)` tensor per layer)
give one buffer per layer instead (`layer_buffers`): the same layout, with layer l's bytes in its own
region, at offset (kv * pages + p) * page_bytes. A pool with `halves=1` keeps each page's K and V
together (vLLM's CPU cache: `(blocks, kv_heads, block_size, 2 * head_size)` per layer): page p of
layer l is at (l * pages + p) * page_bytes and holds both.
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
    """Shape of a paged pool in bytes: layers x halves x pages x page_bytes.

    halves: 2 when a layer's K pages come before its V pages, 1 when each page holds both.
    """

    layers: int
    pages: int
    page_bytes: int
    halves: int = 2

    def __post_init__(self) -> None:
        if not 0 < self.layers <= MAX_LAYERS:
            raise ValueError(f"layers must be in 1..{MAX_LAYERS}, not {self.layers}")
        if self.pages <= 0 or self.page_bytes <= 0:
            raise ValueError(f"pages and page_bytes must be positive, not {self.pages}, {self.page_bytes}")
        if self.halves not in (1, 2):
            raise ValueError(f"halves must be 1 or 2, not {self.halves}")

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return self.layers * self.layer_nbytes

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's pages (K and V)."""
        return self.halves * self.pages * self.page_bytes

    def offset(self, layer: int, kv: int, page: int) -> int:
        """Byte offset of page `page` of layer `layer`, half kv (0 = K, 1 = V)."""
        return ((layer * self.halves + kv) * self.pages + page) * self.page_bytes

    def check_pages(self, pages: Sequence[int], what: str) -> list[int]:
        """The pages as ints; KvError naming `what` when one is out of range."""
        out = [int(p) for p in pages]
        bad = [p for p in out if not 0 <= p < self.pages]
        if bad:
            raise KvError(f"{what}: page id {bad[0]} is outside 0..{self.pages - 1}")
        return out

    def to_dict(self) -> dict[str, int]:
        """JSON form for the handshake."""
        d = {"layers": self.layers, "pages": self.pages, "page_bytes": self.page_bytes}
        if self.halves != 2:  # peers that predate halves read the default
            d["halves"] = self.halves
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KvGeometry:
        """Inverse of to_dict; ValueError on missing or bad fields."""
        return cls(int(d["layers"]), int(d["pages"]), int(d["page_bytes"]), int(d.get("halves", 2)))


class KvPool:
    """A paged KV pool registered once with an engine.

    buffer: a contiguous CPU tensor or writable buffer of exactly geometry.nbytes (e.g. the
    model's cache viewed as bytes); by default a zeroed numpy array is allocated.
    layer_buffers: instead of buffer, one buffer per layer of exactly halves * pages * page_bytes
    each, each registered as its own region. halves: see KvGeometry.
    """

    def __init__(
        self,
        engine: TransferEngine,
        *,
        layers: int,
        pages: int,
        page_bytes: int,
        halves: int = 2,
        buffer: Any = None,
        layer_buffers: Sequence[Any] | None = None,
        access: str = "rw",
    ) -> None:
        self.engine = engine
        self.geometry = KvGeometry(layers, pages, page_bytes, halves)
        if layer_buffers is not None:
            if buffer is not None:
                raise ValueError("give a pool buffer or layer_buffers, not both")
            if len(layer_buffers) != layers:
                raise ValueError(f"{len(layer_buffers)} layer buffers for {layers} layers")
            buffers, want = list(layer_buffers), self.layer_nbytes
        else:
            if buffer is None:
                import numpy as np  # only pools without a caller's buffer need numpy

                buffer = np.zeros(self.geometry.nbytes, dtype=np.uint8)
            buffers, want = [buffer], self.geometry.nbytes
        self.buffer: Any = buffers[0] if layer_buffers is None else None
        self.per_layer = layer_buffers is not None  # each layer its own region
        self.regions: list[Region] = []
        try:
            for i, buf in enumerate(buffers):
                region = engine.register(buf, access)
                self.regions.append(region)
                if region.nbytes != want:
                    what = "pool buffer" if layer_buffers is None else f"layer {i} buffer"
                    raise ValueError(f"{what} has {region.nbytes} bytes, geometry needs {want}")  # noqa: TRY301
        except BaseException:
            self.close()
            raise
        self.region: Region = self.regions[0]

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's K and V pages."""
        return self.geometry.layer_nbytes

    @property
    def descriptor(self) -> MemoryRegionDescriptor:
        """What peers need to write into this pool (its first layer's region when per_layer)."""
        return self.region.descriptor

    def descriptors(self) -> list[MemoryRegionDescriptor]:
        """Every region's descriptor: one, or one per layer."""
        return [r.descriptor for r in self.regions]

    def layer_region(self, layer: int) -> tuple[Region, int]:
        """(region, byte offset of the layer's first page in it) for `layer`."""
        if self.per_layer:
            return self.regions[layer], 0
        return self.region, self.geometry.offset(layer, 0, 0)

    def close(self) -> None:
        """Deregister the pool (no transfer may still be running on it)."""
        for region in self.regions:
            region.close()


def layer_spans(
    src: KvGeometry,
    src_pages: Sequence[int],
    dst: KvGeometry,
    dst_pages: Sequence[int],
    layer: int,
    *,
    src_layer_base: int | None = None,
    dst_layer_base: int | None = None,
) -> list[tuple[int, int, int]]:
    """(src_offset, dst_offset, length) for layer's K and V pages, merging pages adjacent on both sides.

    Offsets are into the whole pool, or, with *_layer_base given, relative to that byte offset of
    the layer's first page (a pool with one region per layer passes 0).
    """
    page = src.page_bytes
    s_layer = src.offset(layer, 0, 0) if src_layer_base is None else src_layer_base
    d_layer = dst.offset(layer, 0, 0) if dst_layer_base is None else dst_layer_base
    spans: list[tuple[int, int, int]] = []
    for kv in range(src.halves):
        s_base = s_layer + kv * src.pages * page
        d_base = d_layer + kv * dst.pages * page
        spans += page_spans(src_pages, s_base, page, dst_pages, d_base, page, page)
    return spans
