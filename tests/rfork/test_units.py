"""Unit tests of the parts that need neither transport nor planner: checksum, identity, manifests,
layout, checkpoints (generator, headers, TP sharding, disk loader) and the small model."""

from __future__ import annotations

import base64
import contextlib
import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.layout import plan_layout
from backends.sharding import shard_range, split_dim
from rfork.errors import ManifestError
from rfork.identity import IdentityError, SourceIdentity, fingerprint, global_rank
from rfork.weights import checksum as ck
from rfork.weights.checkpoint import load_rank_from_disk, load_state_dict, read_checkpoint_info
from rfork.weights.manifest import RankManifest
from rfork.weights.memory import pack
from rfork.weights.synthetic import config_for_size, write_synthetic_checkpoint
from tests.tiny_llama import LlamaForCausalLM

# ------------------------------------------------------------------ checksum


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4095, ck.CHUNK_WORDS * 8 + 13, 3 * ck.CHUNK_WORDS * 8 + 5])
def test_checksum_matches_reference(n):
    raw = os.urandom(n)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    assert ck.checksum_bytes(t) == ck.reference_checksum(raw)


def test_checksum_sees_one_flipped_byte_and_swapped_words():
    t = torch.randn(1 << 18, dtype=torch.float32)
    base = ck.tensor_checksum(t)
    u = t.clone().view(torch.uint8)
    u[12345] ^= 1
    assert ck.tensor_checksum(u) != base
    w = t.clone().view(torch.int64)
    w[[10, 20]] = w[[20, 10]]
    assert ck.tensor_checksum(w) != base


def test_checksum_is_dtype_and_view_independent_and_handles_unaligned():
    t = torch.randn(1001, dtype=torch.bfloat16)
    assert (
        ck.tensor_checksum(t) == ck.tensor_checksum(t.view(torch.uint8)) == ck.tensor_checksum(t.view(7, 143))
    )
    buf = torch.zeros(4000, dtype=torch.uint8)
    buf[3 : 3 + 2002] = t.view(torch.uint8)
    assert ck.xxh3_bytes(buf[3 : 3 + 2002]) == ck.tensor_checksum(t)
    assert ck.checksum_bytes(buf[3 : 3 + 2002]) == ck.checksum_bytes(t.view(torch.uint8))  # pwsum too


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_checksum_same_on_cuda():
    t = torch.randn(3_000_001, dtype=torch.bfloat16)
    assert ck.tensor_checksum(t.cuda()) == ck.checksum_bytes(t.view(torch.uint8))  # pwsum64 on the GPU


# ------------------------------------------------------------------ identity


def test_fingerprint_ignores_order_and_sees_shape_and_dtype():
    a = [("x", "bfloat16", (2, 3)), ("y", "float32", (4,))]
    assert fingerprint(a) == fingerprint(list(reversed(a)))
    assert fingerprint(a) != fingerprint([("x", "bfloat16", (3, 2)), ("y", "float32", (4,))])
    assert fingerprint(a) != fingerprint([("x", "float16", (2, 3)), ("y", "float32", (4,))])


def test_identity_round_trip_and_validation():
    ident = SourceIdentity(model="m", revision="r", fingerprint="f", dtype="bfloat16", tp=2, pp=2)
    assert SourceIdentity.from_dict(json.loads(json.dumps(ident.to_dict()))) == ident
    assert ident.world_size == 4
    assert len(ident.key()) == 64
    with pytest.raises(IdentityError):
        SourceIdentity.from_dict({k: v for k, v in ident.to_dict().items() if k != "tp"})
    with pytest.raises(IdentityError):
        SourceIdentity(model="m", revision="r", fingerprint="f", dtype="bf16", tp=0)
    assert global_rank(tp_rank=1, pp_rank=1, tp_size=2) == 3  # not tp_rank alone
    with pytest.raises(IdentityError):
        global_rank(tp_rank=2, pp_rank=0, tp_size=2)


names = st.text(alphabet="abcdefghij._0123456789", min_size=1, max_size=20)
dtypes = st.sampled_from(["bfloat16", "float16", "float32", "int8", "int64"])
shapes = st.lists(st.integers(min_value=0, max_value=9), min_size=0, max_size=3)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(names, st.tuples(dtypes, shapes), min_size=1, max_size=12), st.randoms())
def test_fingerprint_is_a_function_of_the_set(specs, rnd):
    items = [(n, d, s) for n, (d, s) in specs.items()]
    shuffled = list(items)
    rnd.shuffle(shuffled)
    assert fingerprint(items) == fingerprint(shuffled)


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(names, st.tuples(dtypes, shapes), min_size=0, max_size=12),
    st.integers(min_value=1, max_value=4096),
)
def test_manifest_round_trip_from_any_layout(specs, max_region):
    layout = plan_layout([(n, d, s) for n, (d, s) in specs.items()], max_region_bytes=max_region)
    doc = {
        "rank": 3,
        "checksum_algorithm": ck.XXH3_128,
        "regions": [
            {"index": i, "nbytes": n, "descriptor": base64.b64encode(b"d%d" % i).decode()}
            for i, n in enumerate(layout.region_sizes)
        ],
        "tensors": [
            {
                "name": p.name,
                "dtype": p.dtype,
                "shape": list(p.shape),
                "nbytes": p.nbytes,
                "region": p.region,
                "offset": p.offset,
                "checksum": "0" * 32,
            }
            for p in layout.placements
        ],
    }
    m = RankManifest.from_dict(json.loads(json.dumps(doc)))
    assert m.to_dict() == doc
    # regions never overlap and stay in bounds
    for r in range(len(layout.region_sizes)):
        spans = sorted(
            (p.offset, p.offset + p.nbytes) for p in layout.placements if p.region == r and p.nbytes
        )
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert all(end <= layout.region_sizes[r] for _, end in spans)


@settings(max_examples=80, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=4),
        max_leaves=12,
    )
)
def test_manifest_parser_rejects_garbage_with_manifest_error(doc):
    with contextlib.suppress(ManifestError):
        RankManifest.from_dict(doc)


def _good_doc():
    return {
        "rank": 0,
        "checksum_algorithm": ck.XXH3_128,
        "regions": [{"index": 0, "nbytes": 16, "descriptor": base64.b64encode(b"x").decode()}],
        "tensors": [
            {
                "name": "w",
                "dtype": "float32",
                "shape": [2, 2],
                "nbytes": 16,
                "region": 0,
                "offset": 0,
                "checksum": "0" * 32,
            }
        ],
    }


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("tensors", 0, "nbytes"), 12),
        (("tensors", 0, "offset"), 4),
        (("tensors", 0, "region"), 1),
        (("tensors", 0, "dtype"), "complex999"),
        (("regions", 0, "descriptor"), "!!"),
        (("rank",), -1),
        (("tensors", 0, "shape"), [2, "2"]),
        (("checksum_algorithm",), ""),
    ],
)
def test_manifest_rejects_inconsistent_fields(path, value):
    doc = _good_doc()
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ManifestError):
        RankManifest.from_dict(doc)


# ------------------------------------------------------------------ layout and checkpoints


def test_pack_keeps_values_and_zero_byte_tensors():
    t = {"a": torch.randn(3, 5).bfloat16(), "empty": torch.empty(0, 4), "b": torch.arange(10.0)}
    layout, buffers, views = pack(t, max_region_bytes=40)
    assert len(buffers) == 2
    assert layout.placements[1].nbytes == 0
    for k, v in t.items():
        assert torch.equal(v, views[k])
        assert views[k].dtype == v.dtype


def test_config_for_size_is_close():
    for size in (20 << 20, 2 << 30):
        cfg = config_for_size(size)
        assert 0.8 < cfg.nbytes() / size < 1.25
        assert cfg.num_hidden_layers >= 4


def test_synthetic_checkpoint_sharded_deterministic_and_loadable(tmp_path):
    cfg = config_for_size(4 << 20)
    a = write_synthetic_checkpoint(tmp_path / "a", config=cfg, shard_bytes=1 << 20)
    b = write_synthetic_checkpoint(tmp_path / "b", config=cfg, shard_bytes=1 << 20)
    assert (a / "model.safetensors.index.json").exists()
    assert len(list(a.glob("*.safetensors"))) > 1
    ia, ib = read_checkpoint_info(a), read_checkpoint_info(b)
    assert ia.fingerprint() == ib.fingerprint()
    assert ia.identity() == ib.identity()
    sa, sb = load_state_dict(a), load_state_dict(b)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert "model.layers.0.self_attn.q_proj.weight" in sa
    assert sa["model.embed_tokens.weight"].dtype == torch.bfloat16
    from safetensors.torch import load_file

    ref = {}
    for f in a.glob("*.safetensors"):
        ref.update(load_file(str(f)))
    assert all(torch.equal(ref[k], sa[k]) for k in ref)


def test_tp_sharding_rule_reassembles(tmp_path):
    cfg = config_for_size(4 << 20)
    d = write_synthetic_checkpoint(tmp_path, config=cfg)
    full = load_state_dict(d)
    parts = [load_state_dict(d, tp=2, rank=r) for r in range(2)]
    for name, t in full.items():
        dim = split_dim(name, t.dim())
        if dim is None:
            assert all(torch.equal(p[name], t) for p in parts)
        else:
            assert torch.equal(torch.cat([p[name] for p in parts], dim), t)
    assert split_dim("model.layers.0.self_attn.o_proj.weight", 2) == 1
    assert split_dim("model.layers.0.mlp.gate_proj.weight", 2) == 0
    assert shard_range(5, 2, 0) == (0, 3)
    assert shard_range(5, 2, 1) == (3, 5)


def test_zero_byte_tensor_survives_checkpoint(tmp_path):
    cfg = config_for_size(2 << 20)
    d = write_synthetic_checkpoint(tmp_path, config=cfg, extra_tensors={"extra.empty": torch.empty(0, 8)})
    layout, _, views = load_rank_from_disk(read_checkpoint_info(d))
    assert views["extra.empty"].shape == (0, 8)
    assert any(p.nbytes == 0 for p in layout.placements)


def test_model_runs_and_is_deterministic(tmp_path):
    cfg = config_for_size(2 << 20)
    d = write_synthetic_checkpoint(tmp_path, config=cfg)
    m1, m2 = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg)
    m1.load_state_dict(load_state_dict(d), assign=True)
    m2.load_state_dict(load_state_dict(d), assign=True)
    ids = torch.arange(16).view(2, 8) % cfg.vocab_size
    with torch.no_grad():
        out1, out2 = m1(ids), m2(ids)
    assert out1.shape == (2, 8, cfg.vocab_size)
    assert torch.isfinite(out1.float()).all()
    assert torch.equal(out1, out2)


def test_default_labels_from_env_else_hostname(monkeypatch):
    import socket

    from rfork.seed.seed import default_labels

    for var in ("RFORK_NODE", "RFORK_RACK", "RFORK_ZONE"):
        monkeypatch.delenv(var, raising=False)
    assert default_labels() == {"node": socket.gethostname(), "rack": "rack0", "zone": "zone0"}
    monkeypatch.setenv("RFORK_NODE", "node-a")
    monkeypatch.setenv("RFORK_RACK", "r7")
    monkeypatch.setenv("RFORK_ZONE", "z2")
    assert default_labels() == {"node": "node-a", "rack": "r7", "zone": "z2"}
    monkeypatch.setenv("RFORK_RACK", "")  # empty counts as unset
    assert default_labels()["rack"] == "rack0"
