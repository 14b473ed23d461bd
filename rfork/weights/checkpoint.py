"""Safetensors checkpoints on disk: headers (names, dtypes, shapes, offsets), the identity they give,
and the disk loader, which reads one TP rank's slice straight into region buffers or a caller's
tensors (sharded by `backends.sharding`).
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from backends import (
    DEFAULT_MAX_REGION_BYTES,
    Layout,
    Placement,
    dtype_from_name,
    dtype_name,
    plan_layout,
    shard_shape,
    shard_tensor,
    split_dim,
    views,
)
from rfork.errors import CheckpointError
from rfork.identity import CHECKPOINT_LAYOUT, SourceIdentity, fingerprint
from rfork.weights.memory import allocate

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_ST_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


# ---------------------------------------------------------------- reading checkpoints


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """A checkpoint's headers: each tensor's record (`Placement`: `region` indexes `files`, `offset` is
    the absolute byte offset of its data in that file), in file and offset order; and config.json."""

    directory: Path
    files: tuple[Path, ...]
    tensors: tuple[Placement, ...]
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return str(self.config.get("_name_or_path") or self.directory.name)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def dtype(self) -> str:
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.nbytes
        return max(counts, key=lambda k: counts[k]) if counts else "none"

    def fingerprint(self) -> str:
        return fingerprint((t.name, t.dtype, t.shape) for t in self.tensors)

    def identity(
        self,
        *,
        tp: int = 1,
        pp: int = 1,
        revision: str = "main",
        model: str | None = None,
        device_kind: str = "cpu",
    ) -> SourceIdentity:
        return SourceIdentity(
            model=model or self.model_name,
            revision=revision,
            fingerprint=self.fingerprint(),
            dtype=self.dtype,
            quantization="none",
            tp=tp,
            pp=pp,
            ep=1,
            dp=1,
            framework="rfork",
            framework_version=CHECKPOINT_LAYOUT,  # the bytes' layout, not this release (rfork.identity)
            device_kind=device_kind,
        )


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise CheckpointError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_count(v: object) -> bool:
    """A non-negative JSON integer (not a bool, which Python counts as an int)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _read_header(path: Path, file_index: int) -> list[Placement]:
    """One file's tensors, checked strictly: a JSON object without duplicate keys; per tensor a known
    dtype, a shape of non-negative integers, `data_offsets` [begin, end] with begin <= end <= the data
    size and end - begin == numel * itemsize; spans that overlap must be identical (tied: the same
    dtype and shape too). CheckpointError names the file and the tensor."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (too short)")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > 100 << 20:
            raise CheckpointError(f"{path}: header of {hlen} bytes is implausible")
        raw = f.read(hlen)
        size = os.fstat(f.fileno()).st_size
    if len(raw) != hlen:
        raise CheckpointError(f"{path}: header of {hlen} bytes, but the file holds {len(raw)}")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (ValueError, CheckpointError) as exc:
        raise CheckpointError(f"{path}: bad safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    data_size = size - 8 - hlen
    base = 8 + hlen
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            if not isinstance(meta, dict):
                raise CheckpointError(f"{path}: __metadata__ is not a JSON object")
            continue
        out.append(_placement(path, file_index, name, meta, data_size, base))
    _check_spans(path, out)
    return out


def _placement(path: Path, file_index: int, name: str, meta: object, data_size: int, base: int) -> Placement:
    where = f"{path}: tensor {name!r}"
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: its entry is not a JSON object")
    st, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(st, str) or st not in _ST_DTYPES:
        raise CheckpointError(f"{where} has unsupported dtype {st!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(v) for v in offsets):
        raise CheckpointError(
            f"{where}: data_offsets {offsets!r} is not [begin, end] (non-negative integers)"
        )
    begin, end = offsets
    if not begin <= end <= data_size:
        raise CheckpointError(
            f"{where}: data_offsets [{begin}, {end}] are not within the {data_size} data bytes"
        )
    numel = 1
    for d in shape:
        numel *= d
    want = numel * dtype_from_name(_ST_DTYPES[st]).itemsize
    if end - begin != want:
        raise CheckpointError(
            f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, but {st}{shape} is {want}"
        )
    return Placement(
        name=name, dtype=_ST_DTYPES[st], shape=tuple(shape), nbytes=end - begin, region=file_index,
        offset=base + begin,
    )


def _check_spans(path: Path, tensors: list[Placement]) -> None:
    """Spans of one file may not overlap unless identical in offset, size, dtype and shape (a tied
    tensor stored once); zero-byte tensors overlap nothing."""
    spans = sorted((t for t in tensors if t.nbytes), key=lambda t: (t.offset, t.nbytes, t.name))
    prev: Placement | None = None
    for t in spans:
        if prev is not None and t.offset < prev.offset + prev.nbytes:
            if (t.offset, t.nbytes, t.dtype, t.shape) != (prev.offset, prev.nbytes, prev.dtype, prev.shape):
                raise CheckpointError(
                    f"{path}: tensor {t.name!r} overlaps tensor {prev.name!r} (not the same span, dtype and "
                    "shape: only a tied tensor may share bytes)"
                )
            continue  # keep the first of the tied group as the reference
        prev = t


def _index_files(d: Path, index: Path) -> tuple[list[str], dict[str, str]]:
    """The files an index names, each a relative path inside `d` (no absolute paths, no `..`, no link
    out of the directory), and its weight_map; CheckpointError naming the index and the entry."""
    try:
        doc = json.loads(index.read_text(encoding="utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (OSError, ValueError, CheckpointError) as exc:
        raise CheckpointError(f"{index}: unreadable index: {exc}") from exc
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: no weight_map object")
    root = d.resolve()
    for name, fname in weight_map.items():
        if not isinstance(fname, str) or not fname or "\0" in fname or Path(fname).is_absolute():
            raise CheckpointError(f"{index}: tensor {name!r} maps to {fname!r}, not a relative file name")
        resolved = (d / fname).resolve()
        if ".." in Path(fname).parts or not resolved.is_relative_to(root) or resolved == root:
            raise CheckpointError(f"{index}: tensor {name!r} maps to {fname!r}, outside {d}")
    return sorted(set(weight_map.values())), weight_map


def read_checkpoint_info(directory: str | Path) -> CheckpointInfo:
    """Headers only (no weight bytes): tensor names, dtypes, shapes and file offsets; plus config.json.
    `directory` may also be one .safetensors file (its directory gives config.json and the name)."""
    d = Path(directory)
    single = d.is_file() and d.suffix == ".safetensors"
    if single:
        d, files = d.parent, [d.name]
    elif not d.is_dir():
        raise CheckpointError(f"checkpoint {d} is neither a directory nor a .safetensors file")
    index = d / INDEX_NAME
    weight_map: dict[str, str] | None = None
    if single:
        pass  # that file alone
    elif index.exists():
        files, weight_map = _index_files(d, index)
    elif (d / SINGLE_NAME).exists():
        files = [SINGLE_NAME]
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{d}: no safetensors files")
    paths = sorted((d / fname for fname in files), key=str)
    tensors: list[Placement] = []
    seen: dict[str, Path] = {}
    for i, path in enumerate(paths):
        if not path.is_file():
            raise CheckpointError(f"{d}: {path.name} is named by the index but is not a file")
        for t in _read_header(path, i):
            if t.name in seen:
                raise CheckpointError(f"{path}: tensor {t.name!r} is also in {seen[t.name]}")
            mapped = weight_map.get(t.name) if weight_map is not None else None
            if mapped is not None and (d / mapped).resolve() != path.resolve():
                raise CheckpointError(f"{path}: tensor {t.name!r} is mapped to {mapped!r} by the index")
            seen[t.name] = path
            tensors.append(t)
    tensors.sort(key=lambda t: (t.region, t.offset))
    config = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else {}
    return CheckpointInfo(directory=d, files=tuple(paths), tensors=tuple(tensors), config=config)


def rank_layout(
    info: CheckpointInfo, *, tp: int = 1, rank: int = 0, max_region_bytes: int = DEFAULT_MAX_REGION_BYTES
) -> Layout:
    return plan_layout(
        [(t.name, t.dtype, shard_shape(t.name, t.shape, tp, rank)) for t in info.tensors],
        max_region_bytes=max_region_bytes,
    )


def load_rank_from_disk(
    info: CheckpointInfo,
    *,
    tp: int = 1,
    rank: int = 0,
    max_region_bytes: int = DEFAULT_MAX_REGION_BYTES,
) -> tuple[Layout, list[torch.Tensor], dict[str, torch.Tensor]]:
    """Read one TP rank's slice straight into freshly allocated regions (no intermediate copy at tp=1)."""
    layout = rank_layout(info, tp=tp, rank=rank, max_region_bytes=max_region_bytes)
    buffers = allocate(layout)
    placed = views(layout, buffers)
    read_rank_into(info, placed, tp=tp, rank=rank)
    return layout, buffers, placed


def read_rank_into(
    info: CheckpointInfo, tensors: Mapping[str, torch.Tensor], *, tp: int = 1, rank: int = 0
) -> None:
    """Read one TP rank's slice into the caller's host tensors (same names, dtypes and shapes).

    Raises CheckpointError naming the first tensor that is missing, extra, or of another dtype/shape.
    """
    by_name = {t.name: t for t in info.tensors}
    for name in tensors:
        if name not in by_name:
            raise CheckpointError(f"{info.directory}: destination tensor {name!r} is not in the checkpoint")
    for t in info.tensors:
        dest = tensors.get(t.name)
        want = shard_shape(t.name, t.shape, tp, rank)
        if dest is None:
            raise CheckpointError(f"{info.directory}: tensor {t.name!r} has no destination")
        if dtype_name(dest.dtype) != t.dtype or tuple(dest.shape) != want:
            raise CheckpointError(
                f"{info.directory}: tensor {t.name!r} is {t.dtype}{list(want)} on disk, "
                f"the destination {dtype_name(dest.dtype)}{list(dest.shape)}"
            )
        if dest.device.type != "cpu" or not dest.is_contiguous():
            raise CheckpointError(f"tensor {t.name!r}: the disk loader reads into contiguous host tensors")
    total = 0
    direct: list[tuple[Placement, torch.Tensor]] = []  # straight from the file into the destination
    sharded: list[tuple[Placement, torch.Tensor]] = []
    for t in info.tensors:
        dest = tensors[t.name]
        if dest.numel() * dest.element_size() == 0:
            continue
        total += dest.numel() * dest.element_size()
        if tp == 1 or split_dim(t.name, len(t.shape)) is None:
            direct.append((t, dest))
        else:
            sharded.append((t, dest))
    fds: dict[Path, int] = {}
    try:
        for path in info.files:
            fds[path] = os.open(path, os.O_RDONLY)
        _read_ranges(info, fds, direct)
        for t, dest in sharded:  # read whole, keep this rank's slice
            full = torch.empty(t.nbytes, dtype=torch.uint8)
            _read_ranges(info, fds, [(t, full)])
            full_t = full.view(dtype_from_name(t.dtype)).view(t.shape)
            dest.detach().copy_(shard_tensor(t.name, full_t, tp, rank))
    finally:
        for fd in fds.values():
            os.close(fd)
    log.info(
        "read rank %d/%d from %s: %d bytes into %d tensor(s)", rank, tp, info.directory, total, len(tensors)
    )


# Reads in flight at once, and their size. One sequential reader leaves a cold disk (and a VM's virtio
# queue) mostly idle between requests; several positioned reads keep it busy, as Run:ai Model Streamer
# does with its reader threads (measured in docs/benchmarks.md, "Disk fallback"). os.preadv releases
# the GIL, so threads read in parallel into the destination's own memory: no bounce buffer.
READ_THREADS = 8
READ_CHUNK_BYTES = 16 << 20


def _read_ranges(
    info: CheckpointInfo, fds: Mapping[Path, int], items: list[tuple[Placement, torch.Tensor]]
) -> None:
    """Read each tensor's bytes from its file into its destination, in chunks across reader threads,
    in file order; CheckpointError naming the tensor on a short read."""
    jobs: list[tuple[Placement, int, memoryview]] = []
    for t, dest in items:
        mv = memoryview(dest.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
        for off in range(0, len(mv), READ_CHUNK_BYTES):
            jobs.append((t, off, mv[off : off + READ_CHUNK_BYTES]))
    if not jobs:
        return

    def read_one(job: tuple[Placement, int, memoryview]) -> None:
        t, off, view = job
        path = info.files[t.region]
        fd, got = fds[path], 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], t.offset + off + got)
            if n <= 0:
                raise CheckpointError(f"{path}: truncated data for tensor {t.name!r}")
            got += n

    if len(jobs) == 1:
        read_one(jobs[0])
        return
    pool = ThreadPoolExecutor(max_workers=min(READ_THREADS, len(jobs)), thread_name_prefix="rfork-disk")
    try:
        for _ in pool.map(read_one, jobs):
            pass
    finally:  # on an error or a signal: the reads in flight end, the queued ones are dropped
        pool.shutdown(wait=True, cancel_futures=True)


def load_state_dict(directory: str | Path, *, tp: int = 1, rank: int = 0) -> dict[str, torch.Tensor]:
    """Convenience: a rank's tensors (views into regions) from a checkpoint directory."""
    return load_rank_from_disk(read_checkpoint_info(directory), tp=tp, rank=rank)[2]
