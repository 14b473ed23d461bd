"""The model shapes the framework tests run besides a dense bf16 Llama, written from one by the tests.

Each writer starts from a directory `write_servable_llama` wrote (config, safetensors, tokenizer) and
rewrites its config and tensors in place, so one tiny-model writer stays the source of every shape:
- `to_mixtral`: a Mixtral (MoE): every MLP becomes `num_experts` experts and a router;
- `to_w8a8`: a compressed-tensors W8A8 checkpoint, int8 or fp8: per-channel 8-bit linear weights with
  a `weight_scale`, dynamic per-token 8-bit activations (lm_head stays bf16);
- `to_w4a16`: a compressed-tensors int4 weight-only checkpoint (packed int4, a scale per group of 32).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rfork.weights.checkpoint import INDEX_NAME
from rfork.weights.synthetic import synthetic_tensor

_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight")
# the decoder's linear weights, a Mixtral's experts included (its router stays bf16)
_LINEAR = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123])"
    r"\.weight"
)
_EXPERT_NAMES = {"gate": "w1", "down": "w2", "up": "w3"}  # Mixtral's names for the SwiGLU matrices


def _rewrite(directory: Path, tensors: dict[str, torch.Tensor], config_update: dict[str, object]) -> None:
    """Replace the checkpoint's safetensors with one file of `tensors` and update its config.json."""
    for f in directory.glob("*.safetensors"):
        f.unlink()
    name = "model-00001-of-00001.safetensors"
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    save_file(contiguous, str(directory / name), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(tensors, name)}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=1))
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(config_update)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))


def _read(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def to_mixtral(directory: Path, *, num_experts: int = 4, top_k: int = 2) -> Path:
    """Rewrite the Llama in `directory` as a Mixtral: expert e of layer n gets the Llama's MLP
    matrices perturbed by a per-expert tensor (so experts differ), and a bf16 router per layer."""
    src = _read(directory)
    out: dict[str, torch.Tensor] = {}
    for name, t in src.items():
        m = _MLP.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        layer, which = m.group(1), m.group(2)
        moe = f"model.layers.{layer}.block_sparse_moe."
        for e in range(num_experts):
            expert = f"{moe}experts.{e}.{_EXPERT_NAMES[which]}.weight"
            out[expert] = t + synthetic_tensor(expert, "bfloat16", tuple(t.shape), seed=e)
        if which == "gate":
            router = f"{moe}gate.weight"
            out[router] = synthetic_tensor(router, "bfloat16", (num_experts, t.shape[1])) * 10
    _rewrite(
        directory,
        out,
        {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": num_experts,
            "num_experts_per_tok": top_k,
            "router_aux_loss_coef": 0.0,
            "output_router_logits": False,
            "sliding_window": None,
        },
    )
    return directory


def w8a8_config(kind: str) -> dict[str, Any]:
    """compressed-tensors' quantization_config for W8A8 of `kind` ("int" or "float", i.e. fp8):
    per-channel static weights, dynamic per-token activations, lm_head left in bf16."""
    args = {"num_bits": 8, "type": kind, "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": f"{kind}-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head", "re:.*block_sparse_moe\\.gate$"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**args, "strategy": "channel", "dynamic": False},
                "input_activations": {**args, "strategy": "token", "dynamic": True},
            }
        },
    }


# the largest magnitude of each weight type, and how a scaled value is stored
_W8 = {
    "int": (127.0, lambda x: torch.clamp(torch.round(x), -127, 127).to(torch.int8)),
    "float": (448.0, lambda x: x.to(torch.float8_e4m3fn)),
}


def quantize_per_channel(weight: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel 8-bit weights of `kind` and their float32 scales ([out, 1])."""
    top, store = _W8[kind]
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / top).clamp(min=1e-8)
    return store(w / scale), scale


def to_w8a8(directory: Path, kind: str = "int") -> Path:
    """Rewrite the Llama in `directory` as a compressed-tensors W8A8 checkpoint (`w8a8_config`):
    every decoder linear weight 8-bit with a `weight_scale`."""
    out: dict[str, torch.Tensor] = {}
    for name, t in _read(directory).items():
        if _LINEAR.fullmatch(name) is None:
            out[name] = t
            continue
        q, scale = quantize_per_channel(t, kind)
        out[name] = q
        out[name.removesuffix("weight") + "weight_scale"] = scale
    _rewrite(directory, out, {"quantization_config": w8a8_config(kind)})
    return directory


W4A16_GROUP = 32


def w4a16_config(group_size: int = W4A16_GROUP) -> dict[str, Any]:
    """compressed-tensors' quantization_config for int4 weight-only (W4A16): symmetric int4 weights in
    groups of `group_size` along the input, packed eight to an int32; activations stay bf16."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
               "dynamic": False}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 values (as int8 in [-8, 7], shape [out, in]) packed eight to an int32 along the input:
    value 8j+i, offset by 8 to unsigned, in bits 4i..4i+3 of word j (compressed-tensors' order)."""
    u = (q.to(torch.int64) + 8).reshape(q.shape[0], -1, 8)
    words = sum(u[:, :, i] << (4 * i) for i in range(8))
    assert isinstance(words, torch.Tensor)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def to_w4a16(directory: Path, group_size: int = W4A16_GROUP) -> Path:
    """Rewrite the Llama in `directory` as a compressed-tensors int4 W4A16 checkpoint (`w4a16_config`):
    every decoder linear weight as `weight_packed`, `weight_scale` (per group) and `weight_shape`."""
    out: dict[str, torch.Tensor] = {}
    for name, t in _read(directory).items():
        if _LINEAR.fullmatch(name) is None:
            out[name] = t
            continue
        rows, cols = t.shape
        groups = t.float().reshape(rows, cols // group_size, group_size)
        scale = (groups.abs().amax(dim=2, keepdim=True) / 7.0).clamp(min=1e-8)
        q = torch.clamp(torch.round(groups / scale), -8, 7).to(torch.int8).reshape(rows, cols)
        base = name.removesuffix("weight")
        out[base + "weight_packed"] = pack_int4(q)
        out[base + "weight_scale"] = scale.squeeze(2).to(torch.bfloat16)
        out[base + "weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
    _rewrite(directory, out, {"quantization_config": w4a16_config(group_size)})
    return directory


# the hooks' per-rank line: `rfork: MODE mode: rank R, N bytes from SOURCE for a S-byte shard (...)`
_RANK_LINE = re.compile(
    r"rfork: (checkpoint|parameters) mode: rank (\d+), (\d+) bytes from (\S+) for a (\d+)-byte shard"
)


@dataclass(frozen=True)
class RankFacts:
    """What one rank of one server moved, beside its shard's size (from the hook's log line)."""

    server: str
    mode: str
    rank: int
    moved: int
    source: str
    shard: int

    @property
    def ratio(self) -> float:
        return self.moved / self.shard


def rank_facts(name: str, log: str) -> list[RankFacts]:
    """Every per-rank line of server `name`'s log, by rank."""
    facts = [RankFacts(name, m[0], int(m[1]), int(m[2]), m[3], int(m[4])) for m in _RANK_LINE.findall(log)]
    return sorted(facts, key=lambda f: f.rank)


# The shape flow runs up to ten engine processes on two cores and kills no peer, so its reads get a
# wider dead-peer bound than the servers' default 3 s (which the failover tests need): under that load
# a live worker's read can wait past 3 s and the rank falls back to disk.
SHAPE_TIMEOUT_S = 20
SHAPE_BOUND = ("--timeout", str(SHAPE_TIMEOUT_S))


def seed_a_b_in_both_modes(planner: Any, fleet: Any, model: Path, *, tp: int) -> dict[str, list[RankFacts]]:
    """seed -> A -> B in checkpoint mode and P1 -> P2 in parameters mode, for one shape (the fleet's
    servers carry its arguments), every server's greedy tokens equal to the engine's own disk load.

    Round 1: the engine's `--load-format auto` server (the reference tokens), A pulling from an rfork
    seed of the checkpoint, and P1 in parameters mode (no seed: the engine's disk loader, then a
    parameters seed). The rfork seed stops. Round 2: B pulls from A, P2 pulls each rank straight into
    its parameters from P1. Returns each rfork server's per-rank facts, also printed.

    At TP>1 in checkpoint mode each rank of A reads only its slice of the seed's whole tensors and
    serves it as a rank of the TP=tp checkpoint layout, which the operator anchors before B starts
    (`rfork anchor upload --tp`, here its bodies put through the planner's client)."""
    from rfork.seed.seed import Seed
    from rfork.weights.checkpoint import load_rank_from_disk, load_state_dict, read_checkpoint_info
    from rfork.weights.rank_weights import RankWeights
    from tests.integrations.server_flow import ids_by_framework, transfers

    info = read_checkpoint_info(model)
    seed0 = Seed(
        weights=[RankWeights.from_tensors(rank=0, tensors=load_state_dict(model))],
        identity=info.identity(tp=1),
        planner_url=planner.url,
    ).start()
    checkpoint_seeds = set(seed0.instance_ids)
    try:
        auto = fleet.start_auto("auto")
        a = fleet.start_rfork("A", planner_url=planner.url, rfork_args=SHAPE_BOUND)
        p1 = fleet.start_rfork("P1", planner_url=planner.url, mode="parameters", rfork_args=SHAPE_BOUND)
        for s in (auto, a, p1):
            s.wait_ready()
        reference = auto.generate()
        assert a.generate() == reference
        assert p1.generate() == reference
    finally:
        seed0.close()  # the first seed stops: from now on A is the only checkpoint seed
    auto.stop()
    if tp > 1:
        from rfork.cli.digest import anchor_bodies

        args = argparse.Namespace(checkpoint=model, tp=tp, revision="main", model_name=None, no_progress=True)
        for body in anchor_bodies(args):
            planner.put_anchor(body)
    checkpoint_seeds |= ids_by_framework(planner, "rfork")  # A's, one per rank
    b = fleet.start_rfork("B", planner_url=planner.url, rfork_args=SHAPE_BOUND)
    p2 = fleet.start_rfork("P2", planner_url=planner.url, mode="parameters", rfork_args=SHAPE_BOUND)
    for s in (b, p2):
        s.wait_ready()
    assert b.generate() == reference
    assert p2.generate() == reference

    facts = {s.name: rank_facts(s.name, s.log()) for s in (a, p1, b, p2)}
    for f in [f for fs in facts.values() for f in fs]:
        print(f"{f.server} {f.mode} rank {f.rank}: {f.moved} bytes from {f.source}, shard {f.shard} bytes "
              f"({f.ratio:.2f}x)")
    for name in ("A", "B", "P2"):  # P1's engine loader may log nothing of rfork's (SGLang's does not)
        assert [f.rank for f in facts[name]] == list(range(tp)), (name, facts[name])
    checkpoint = info.total_bytes
    assert all(f.source == "rfork-tcp" for f in facts["A"] + facts["B"]), facts
    if tp == 1:
        assert all(f.moved == checkpoint for f in facts["A"] + facts["B"]), facts
    else:  # each rank its slice: from the seed's stripes (A), from A's rank (B), the same bytes
        slices = [load_rank_from_disk(info, tp=tp, rank=r)[0].total_bytes for r in range(tp)]
        assert [f.moved for f in facts["A"]] == slices, facts["A"]
        assert [f.moved for f in facts["B"]] == slices, facts["B"]
    assert all(f.source == "rfork-tcp" and f.ratio <= 1.05 for f in facts["P2"]), facts["P2"]
    assert all(f.source == "disk" for f in facts["P1"]), facts["P1"]
    # the parameters-mode safety check (digests re-checked after the post-load steps) did not fire:
    # P1 served P2, and said nothing about parameters changed in place
    assert "changed the loaded parameters in place" not in p1.log()
    # the planner's transfers, per rank: A and B one checkpoint pull per rank (rank 0 of the tp=1
    # checkpoint), P2 one pull of each rank of P1's, as many bytes as the rank's line says
    done = [t for t in transfers(planner) if t["outcome"] == "success"]
    pulls = [(t["rank"], t["bytes"]) for t in done if t["seed_id"] in checkpoint_seeds]
    if tp == 1:
        assert sorted(pulls) == [(0, checkpoint)] * 2, done
    else:  # A's ranks: rank 0 of the TP=1 seed (their slices); B's: each rank of A's TP=tp layout
        assert sorted(pulls) == sorted([(0, n) for n in slices] + list(enumerate(slices))), done
    into_parameters = sorted((t["rank"], t["bytes"]) for t in done if t["seed_id"] not in checkpoint_seeds)
    assert into_parameters == [(f.rank, f.moved) for f in facts["P2"]], done
    return facts
