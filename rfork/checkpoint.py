"""Safetensors checkpoints: a synthetic Llama-shaped generator, header reading, the TP sharding rule,
and the disk loader (reads straight into layout regions).

Sharding rule for tensor parallelism (Megatron style, as Llama implementations do it):
column-parallel (split dim 0): q/k/v/gate/up projections, the embedding (vocab-parallel) and lm_head;
row-parallel (split dim 1): o_proj and down_proj; everything else (norms) replicated. A dimension
of size d splits like `torch.tensor_split`: the first d % tp ranks get one extra row.
"""

from __future__ import annotations

import json
import logging
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rfork.errors import CheckpointError
from rfork.identity import SourceIdentity, fingerprint
from rfork.layout import DEFAULT_MAX_REGION_BYTES, Layout, allocate, plan_layout, views
from rfork.manifest import dtype_from_name, dtype_name

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
_COLUMN = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "q_proj.bias",
    "k_proj.bias",
    "v_proj.bias",
    "embed_tokens.weight",
    "lm_head.weight",
)
_ROW = ("o_proj.weight", "down_proj.weight")


# ---------------------------------------------------------------- configs and the generator


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.__dict__,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "torch_dtype": "bfloat16",
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        keys = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in keys})

    def tensor_specs(self, dtype: str = "bfloat16") -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every weight, in the usual Llama checkpoint order."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = self.num_key_value_heads * self.head_dim
        specs: list[tuple[str, str, tuple[int, ...]]] = [("model.embed_tokens.weight", dtype, (v, h))]
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            specs += [
                (p + "input_layernorm.weight", dtype, (h,)),
                (p + "self_attn.q_proj.weight", dtype, (h, h)),
                (p + "self_attn.k_proj.weight", dtype, (kv, h)),
                (p + "self_attn.v_proj.weight", dtype, (kv, h)),
                (p + "self_attn.o_proj.weight", dtype, (h, h)),
                (p + "post_attention_layernorm.weight", dtype, (h,)),
                (p + "mlp.gate_proj.weight", dtype, (i, h)),
                (p + "mlp.up_proj.weight", dtype, (i, h)),
                (p + "mlp.down_proj.weight", dtype, (h, i)),
            ]
        specs.append(("model.norm.weight", dtype, (h,)))
        if not self.tie_word_embeddings:
            specs.append(("lm_head.weight", dtype, (v, h)))
        return specs

    def nbytes(self, dtype: str = "bfloat16") -> int:
        from rfork.manifest import dtype_from_name, expected_nbytes

        return sum(expected_nbytes(dtype_from_name(d), s) for _, d, s in self.tensor_specs(dtype))


def config_for_size(target_bytes: int) -> LlamaConfig:
    """A Llama-proportioned bf16 config (intermediate ~2.7x hidden, head_dim 64, GQA 4:1) near target_bytes.

    Picks the widest hidden size that still gives at least 8 layers.
    """
    best = _cfg(128, 2, 1)
    for hidden in (128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 5120, 8192):
        one, two = _cfg(hidden, hidden // 64, 1).nbytes(), _cfg(hidden, hidden // 64, 2).nbytes()
        per_layer, base = two - one, 2 * one - two
        layers = round((target_bytes - base) / per_layer)
        if layers < 8 and hidden > 128:
            break
        best = _cfg(hidden, hidden // 64, max(layers, 1))
    return best


def _cfg(hidden: int, heads: int, layers: int) -> LlamaConfig:
    inter = ((hidden * 8 // 3) + 63) // 64 * 64
    vocab = min(32000, hidden * 16)
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 2),
        vocab_size=vocab,
    )


def synthetic_tensor(name: str, dtype: str, shape: Sequence[int], *, seed: int = 0) -> torch.Tensor:
    """Deterministic pseudo-random weights for one tensor (depends on name, shape and seed only)."""
    from rfork.manifest import dtype_from_name

    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) << 16) ^ seed)
    dt = dtype_from_name(dtype)
    if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
        return (1.0 + torch.empty(tuple(shape), dtype=torch.float32).uniform_(-0.1, 0.1, generator=g)).to(dt)
    return torch.empty(tuple(shape), dtype=dt).normal_(0.0, 0.02, generator=g)


def write_synthetic_checkpoint(
    directory: str | Path,
    *,
    config: LlamaConfig | None = None,
    size_bytes: int | None = None,
    shard_bytes: int = 512 << 20,
    model_name: str | None = None,
    seed: int = 0,
    extra_tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write config.json, model-0000k-of-0000n.safetensors shards and the index json; returns the dir."""
    from safetensors.torch import save_file

    if config is None:
        if size_bytes is None:
            raise CheckpointError("give a config or a size")
        config = config_for_size(size_bytes)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    name = model_name or f"synthetic-llama-h{config.hidden_size}-l{config.num_hidden_layers}"
    (out / "config.json").write_text(json.dumps({**config.to_dict(), "_name_or_path": name}, indent=1))
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    items: list[tuple[str, torch.Tensor]] = [
        (n, synthetic_tensor(n, d, s, seed=seed)) for n, d, s in config.tensor_specs()
    ]
    items += list((extra_tensors or {}).items())
    for n, t in items:
        nb = t.numel() * t.element_size()
        if shards[-1] and used + nb > shard_bytes:
            shards.append({})
            used = 0
        shards[-1][n] = t.contiguous()
        used += nb
    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for n, t in shard.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    (out / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    log.info(
        "wrote synthetic checkpoint %s: %d tensors, %d bytes, %d shard(s)",
        out,
        len(weight_map),
        total,
        len(shards),
    )
    return out


# ---------------------------------------------------------------- reading checkpoints


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    data_offset: int  # absolute byte offset of the tensor's data in `file`
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    directory: Path
    tensors: tuple[TensorInfo, ...]
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
        from rfork import __version__

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
            framework_version=__version__,
            device_kind=device_kind,
        )


def _read_header(path: Path) -> list[TensorInfo]:
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (too short)")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > 100 << 20:
            raise CheckpointError(f"{path}: header of {hlen} bytes is implausible")
        try:
            header = json.loads(f.read(hlen))
        except ValueError as exc:
            raise CheckpointError(f"{path}: bad safetensors header: {exc}") from exc
    base = 8 + hlen
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        st = meta["dtype"]
        if st not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {st}")
        begin, end = meta["data_offsets"]
        out.append(
            TensorInfo(
                name=name,
                dtype=_ST_DTYPES[st],
                shape=tuple(meta["shape"]),
                file=path,
                data_offset=base + begin,
                nbytes=end - begin,
            )
        )
    return out


def read_checkpoint_info(directory: str | Path) -> CheckpointInfo:
    """Headers only (no weight bytes): tensor names, dtypes, shapes and file offsets; plus config.json."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {d} does not exist")
    index = d / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (d / SINGLE_NAME).exists():
        files = [SINGLE_NAME]
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{d}: no safetensors files")
    tensors: list[TensorInfo] = []
    for fname in files:
        tensors += _read_header(d / fname)
    tensors.sort(key=lambda t: (str(t.file), t.data_offset))
    config = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else {}
    return CheckpointInfo(directory=d, tensors=tuple(tensors), config=config)


# ---------------------------------------------------------------- tensor-parallel sharding


def split_dim(name: str, ndim: int) -> int | None:
    """Which dim a tensor is split along under TP (None: replicated)."""
    if any(name.endswith(s) for s in _COLUMN):
        return 0
    if ndim >= 2 and any(name.endswith(s) for s in _ROW):
        return 1
    return None


def shard_range(size: int, tp: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(size, tp)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard_shape(name: str, shape: Sequence[int], tp: int, rank: int) -> tuple[int, ...]:
    dim = split_dim(name, len(shape))
    if tp == 1 or dim is None:
        return tuple(shape)
    lo, hi = shard_range(shape[dim], tp, rank)
    out = list(shape)
    out[dim] = hi - lo
    return tuple(out)


def shard_tensor(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    dim = split_dim(name, full.dim())
    if tp == 1 or dim is None:
        return full
    lo, hi = shard_range(full.shape[dim], tp, rank)
    return full.narrow(dim, lo, hi - lo)


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
    handles: dict[Path, Any] = {}
    total = 0
    try:
        for t in info.tensors:
            dest = tensors[t.name]
            nbytes = dest.numel() * dest.element_size()
            if nbytes == 0:
                continue
            total += nbytes
            f = handles.get(t.file)
            if f is None:
                f = handles[t.file] = t.file.open("rb", buffering=0)
            if tp == 1 or split_dim(t.name, len(t.shape)) is None:
                _read_exact(f, t.data_offset, dest.detach().reshape(-1).view(torch.uint8), t)
            else:
                full = torch.empty(t.nbytes, dtype=torch.uint8)
                _read_exact(f, t.data_offset, full, t)
                full_t = full.view(dtype_from_name(t.dtype)).view(t.shape)
                dest.detach().copy_(shard_tensor(t.name, full_t, tp, rank))
    finally:
        for f in handles.values():
            f.close()
    log.info(
        "read rank %d/%d from %s: %d bytes into %d tensor(s)", rank, tp, info.directory, total, len(tensors)
    )


def _read_exact(f: Any, offset: int, dest: torch.Tensor, t: TensorInfo) -> None:
    mv = memoryview(dest.numpy()).cast("B")  # type: ignore[arg-type]
    f.seek(offset)
    got = 0
    while got < len(mv):
        n = f.readinto(mv[got:])
        if not n:
            raise CheckpointError(f"{t.file}: truncated data for tensor {t.name!r}")
        got += n


def load_state_dict(directory: str | Path, *, tp: int = 1, rank: int = 0) -> dict[str, torch.Tensor]:
    """Convenience: a rank's tensors (views into regions) from a checkpoint directory."""
    return load_rank_from_disk(read_checkpoint_info(directory), tp=tp, rank=rank)[2]
