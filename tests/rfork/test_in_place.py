"""Serving and pulling in place: covering ranges, read plans, digests, and real seeds/loaders over tcp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rfork import Loader, LoadOptions, pull_into
from rfork.errors import ChecksumMismatch, DestinationMismatch, LayoutError
from rfork.identity import SourceIdentity, fingerprint
from rfork.pull.one_sided import plan_reads
from rfork.seed.seed import Seed
from rfork.weights import checksum as ck
from rfork.weights.checkpoint import load_state_dict, read_checkpoint_info
from rfork.weights.manifest import RankManifest, RegionEntry, TensorEntry
from rfork.weights.rank_weights import RankWeights, cover
from rfork.weights.synthetic import write_synthetic_checkpoint
from tests.rfork.conftest import AUTH, REGISTER, SMALL
from tests.tiny_llama import LlamaForCausalLM

# ---------------------------------------------------------------- covering ranges (pure)

# A few backing buffers; tensors are byte spans carved out of them (they may overlap or repeat).
spans_strategy = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 300), st.integers(0, 120)), min_size=1, max_size=25
)


def carve(spans: list[tuple[int, int, int]]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    backing = [torch.arange(512, dtype=torch.int64).to(torch.uint8) + i for i in range(3)]
    tensors = {f"t{i}": backing[b][off : off + n] for i, (b, off, n) in enumerate(spans)}
    return backing, tensors


@given(spans_strategy)
@settings(max_examples=150, deadline=None)
def test_cover_places_every_tensor_in_disjoint_ranges_that_hold_only_tensor_bytes(spans):
    _backing, tensors = carve(spans)
    layout, ranges = cover(tensors)
    assert layout.region_sizes == tuple(r.nbytes for r in ranges)
    for a, b in zip(ranges, ranges[1:], strict=False):
        assert a.ptr + a.nbytes < b.ptr  # sorted, neither overlapping nor touching (those merge)
    covered: set[int] = set()
    for p in layout.placements:
        t = tensors[p.name]
        assert p.nbytes == t.numel()
        if p.nbytes:
            r = ranges[p.region]
            assert r.ptr + p.offset == t.data_ptr()
            assert p.offset + p.nbytes <= r.nbytes
            covered.update(range(t.data_ptr(), t.data_ptr() + p.nbytes))
    assert covered == {a for r in ranges for a in range(r.ptr, r.ptr + r.nbytes)}  # no foreign bytes


def test_cover_counts_tied_storage_once_and_refuses_non_contiguous():
    w = torch.randn(64, 32)
    layout, ranges = cover({"embed": w, "lm_head": w, "empty": torch.empty(0, 4)})
    assert len(ranges) == 1
    assert ranges[0].nbytes == w.numel() * 4
    assert [(p.region, p.offset) for p in layout.placements[:2]] == [(0, 0), (0, 0)]
    with pytest.raises(LayoutError, match="'transposed' is not contiguous"):
        cover({"fine": w, "transposed": w.t()})


@given(spans_strategy)
@settings(max_examples=150, deadline=None)
def test_read_plan_writes_each_destination_byte_once_from_the_right_source_byte(spans):
    _backing, tensors = carve(spans)
    dest = RankWeights.from_tensors(tensors=tensors)
    # The source serves the same names packed one after another in one region (a different layout).
    entries, off = [], 0
    for p in dest.layout.placements:
        entries.append(
            TensorEntry(
                name=p.name, dtype=p.dtype, shape=p.shape, nbytes=p.nbytes, region=0, offset=off, checksum=""
            )
        )
        off += p.nbytes
    manifest = RankManifest(
        rank=0,
        checksum_algorithm=ck.XXH3_128,
        regions=(RegionEntry(index=0, nbytes=off, descriptor=b""),),
        tensors=tuple(entries),
    )
    plan = plan_reads(dest, manifest, chunk_bytes=16)
    written: dict[tuple[int, int], int] = {}  # (region, offset) -> source byte
    for region, reads in enumerate(plan):
        assert [r.offset for r in reads] == sorted(r.offset for r in reads)
        for r in reads:
            assert r.region == region
            assert 0 < r.nbytes <= 16
            for k in range(r.nbytes):
                assert (region, r.offset + k) not in written
                written[(region, r.offset + k)] = r.src_offset + k
    src_of = {e.name: e for e in entries}
    for p in dest.layout.placements:
        for k in range(p.nbytes):
            src = written[(p.region, p.offset + k)]
            # the byte comes from some tensor that holds the same destination byte; here we check the
            # source byte carries the same value as this tensor's own source byte would
            own = src_of[p.name].offset + k
            assert _source_value(entries, tensors, src) == _source_value(entries, tensors, own)


def _source_value(entries: list[TensorEntry], tensors: dict[str, torch.Tensor], src_off: int) -> int:
    for e in entries:
        if e.offset <= src_off < e.offset + e.nbytes:
            return int(tensors[e.name].reshape(-1)[src_off - e.offset])
    raise AssertionError(src_off)


# ---------------------------------------------------------------- digests


@given(st.binary(min_size=0, max_size=5000), st.lists(st.integers(1, 700), max_size=20))
@settings(max_examples=100, deadline=None)
def test_streaming_xxh3_equals_one_shot_for_any_chunking(data, cuts):
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    d = ck.StreamingDigest()
    pos = 0
    for c in cuts:
        n = min(c, len(data) - pos)
        d.update(t.data_ptr() + pos, n)
        pos += n
    d.update(t.data_ptr() + pos, len(data) - pos)
    assert d.hexdigest() == ck.tensor_checksum(t)
    assert len(d.hexdigest()) == 32


def test_host_digest_is_xxh3_and_not_linear():
    import xxhash

    assert ck.algorithm_for("cpu") == ck.XXH3_128
    assert ck.algorithm_for("cuda:0") == ck.PWSUM64
    t = torch.arange(4096, dtype=torch.int64)
    assert ck.tensor_checksum(t) == xxhash.xxh3_128_hexdigest(t.numpy().tobytes())
    # Two changes that cancel in any position-weighted sum (w0 += 2, w1 -= 1, w2 ... ) still differ:
    u = t.clone()
    u[0] += 1
    u[2] += 1
    u[1] -= 2  # sum unchanged and sum of w_i*(i+1) unchanged: (1*1) + (1*3) - (2*2) = 0
    assert int(u.sum()) == int(t.sum())
    assert ck.tensor_checksum(u) != ck.tensor_checksum(t)
    assert ck.checksum_bytes(u.view(torch.uint8)) == ck.checksum_bytes(t.view(torch.uint8))  # pwsum cannot


# ---------------------------------------------------------------- manifest checks


def _manifest_for(tensors: dict[str, torch.Tensor]) -> RankManifest:
    w = RankWeights.from_tensors(tensors=tensors)
    return w.manifest([b"x"] * len(w.ranges))


def test_check_destination_names_the_first_bad_tensor():
    src = {"a": torch.zeros(4, 4), "b": torch.zeros(8, dtype=torch.bfloat16), "c": torch.zeros(2)}
    m = _manifest_for(src)
    RankWeights.from_tensors(tensors={k: v.clone() for k, v in src.items()}).check_matches(m)
    cases = {
        "'b' is bfloat16\\[8\\] at the seed, the destination float32\\[8\\]": {**src, "b": torch.zeros(8)},
        "'a' is float32\\[4, 4\\] at the seed, the destination float32\\[16\\]": {
            **src,
            "a": torch.zeros(16),
        },
        "'c' is in the manifest but has no destination": {"a": src["a"], "b": src["b"]},
        "destination tensor 'd' is not in the manifest": {**src, "d": torch.zeros(1)},
    }
    for message, dest in cases.items():
        with pytest.raises(DestinationMismatch, match=message):
            RankWeights.from_tensors(tensors=dest).check_matches(m)


# ---------------------------------------------------------------- real seeds and loaders


def opts(**kw) -> LoadOptions:
    return LoadOptions(providers=["tcp"], transfer_timeout_s=3.0, rank_deadline_s=60.0, **kw)


def tied_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(SMALL)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: one storage, two names
    model.register_buffer("empty_buf", torch.empty(0, 8))
    return model


def identity_for(model: torch.nn.Module) -> SourceIdentity:
    return SourceIdentity(
        model="in-place-test",
        revision="r1",
        dtype="bfloat16",
        fingerprint=fingerprint((n, str(t.dtype), t.shape) for n, t in model.state_dict().items()),
    )


@pytest.mark.slow
def test_serve_in_place_then_pull_into_a_module_then_serve_from_it(planner):
    model = tied_model(0)
    before = {n: t.data_ptr() for n, t in model.state_dict().items()}
    weights = RankWeights.from_tensors(tensors=model.state_dict())
    assert weights.buffers == []  # nothing copied
    ident = identity_for(model)
    with Seed(
        weights=[weights], identity=ident, planner_url=planner, providers=["tcp"], token=REGISTER
    ) as seed:
        assert {n: t.data_ptr() for n, t in model.state_dict().items()} == before  # not re-pointed
        target = tied_model(1)
        ptrs = {n: t.data_ptr() for n, t in target.state_dict().items()}
        loader = Loader(identity=ident, planner_url=planner, options=opts(), **AUTH)
        a = loader.load_into(target)
        try:
            assert a.source == "rfork-tcp"
            assert a.verified
            assert a.attempts[0].instance_id == seed.instance_ids[0]
            assert {n: t.data_ptr() for n, t in target.state_dict().items()} == ptrs  # pulled in place
            for name, t in model.state_dict().items():
                assert torch.equal(target.state_dict()[name], t), name
            # the loaded instance serves its own tensors: a third instance pulls from it
            third = LlamaForCausalLM(SMALL)
            third.lm_head.weight = third.model.embed_tokens.weight
            third.register_buffer("empty_buf", torch.empty(0, 8))
            b = pull_into(
                identity=ident,
                planner_url=planner,
                tensors=third.state_dict(),
                options=opts(exclude=seed.instance_ids, become_seed=False),
                **AUTH,
            )
            assert a.seed is not None
            assert b.attempts[0].instance_id == a.seed.instance_ids[0]
            for name, t in model.state_dict().items():
                assert torch.equal(third.state_dict()[name], t), name
            b.close()
        finally:
            a.close()


@pytest.mark.slow
def test_pull_into_mismatch_fails_before_any_byte_moves(planner):
    model = tied_model(0)
    ident = identity_for(model)
    with Seed(
        weights=[RankWeights.from_tensors(tensors=model.state_dict())],
        identity=ident,
        planner_url=planner,
        token=REGISTER,
    ):
        dest = {n: torch.full_like(t, 7) for n, t in model.state_dict().items()}
        name = "model.layers.1.mlp.up_proj.weight"
        dest[name] = torch.full((3, 3), 7, dtype=torch.bfloat16)
        with pytest.raises(DestinationMismatch, match=name):
            pull_into(
                identity=ident, planner_url=planner, tensors=dest, options=opts(become_seed=False), **AUTH
            )
        assert all(bool((t == 7).all()) for t in dest.values())  # nothing written


@pytest.mark.slow
def test_corrupt_seed_falls_back_to_disk_into_the_same_tensors(tmp_path, planner):
    ckpt = write_synthetic_checkpoint(tmp_path / "ckpt", config=SMALL, shard_bytes=3 << 20)
    info = read_checkpoint_info(ckpt)
    served = {n: t.clone() for n, t in load_state_dict(ckpt).items()}
    weights = RankWeights.from_tensors(tensors=served)
    with Seed(
        weights=[weights], identity=info.identity(), planner_url=planner, control=False, token=REGISTER
    ):
        victim = next(iter(served.values()))
        victim.view(-1)[3] += 1  # after the digests were published
        dest = {n: torch.empty_like(t) for n, t in served.items()}
        ptrs = {n: t.data_ptr() for n, t in dest.items()}
        result = pull_into(
            identity=info.identity(),
            planner_url=planner,
            tensors=dest,
            checkpoint=ckpt,
            options=opts(become_seed=False),
            **AUTH,
        )
        assert result.source == "disk"
        assert not result.verified  # a disk load has nothing to compare digests with
        assert "checksum" in (result.attempts[0].error or "")
        assert {n: t.data_ptr() for n, t in dest.items()} == ptrs
        reference = load_state_dict(ckpt)
        assert all(torch.equal(dest[n], reference[n]) for n in reference)


def test_mismatching_digest_names_the_tensor():
    t = {"w": torch.arange(10, dtype=torch.float32)}
    w = RankWeights.from_tensors(tensors=t)

    with pytest.raises(ChecksumMismatch, match="'w'"):
        w.verify({"w": "0" * 32})


# ---------------------------------------------------------------- memory: serving adds (almost) nothing

RSS_CHILD = textwrap.dedent(
    """
    import json, os, sys, torch
    from planner.client import PlannerClient  # imported before the baseline: not part of serving
    from rfork.identity import SourceIdentity
    from rfork.seed.seed import RankServer, Seed, open_engine
    from rfork.weights.rank_weights import RankWeights

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    nbytes = int(sys.argv[2])
    tensors = {f"layer{i}.weight": torch.full((nbytes // 8 // 4,), float(i)) for i in range(8)}
    server = RankServer(engine=open_engine("tcp"))
    before = rss()
    weights = RankWeights.from_tensors(tensors=tensors)
    server.serve(weights)
    ident = SourceIdentity(model="rss", revision="r", dtype="float32", fingerprint="f" * 64)
    seed = Seed(weights=[weights], identity=ident, planner_url=sys.argv[1], servers=[server], control=False,
                token=os.environ["RFORK_REGISTER_TOKEN"])
    seed.start()
    after = rss()
    total = sum(t.numel() * 4 for t in tensors.values())
    print(json.dumps({"before": before, "after": after, "weights": total}), flush=True)
    sys.stdin.readline()  # serve until the parent has pulled
    seed.close()
    """
)


@pytest.mark.slow
def test_seed_process_serves_in_place_adding_at_most_one_percent_rss_and_a_loader_pulls_it(planner):
    # 1 GiB, so that the fixed cost of publishing (planner client, heartbeat and publish threads: about
    # 3-4 MiB whatever the model's size) stays under the 1% bound, while any copy of the weights would
    # exceed it a hundredfold
    nbytes = 1 << 30
    proc = subprocess.Popen(
        [sys.executable, "-c", RSS_CHILD, planner, str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RFORK_TCP_HOST": "127.0.0.1"},
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        out = json.loads(proc.stdout.readline())
        assert out["weights"] == nbytes
        grew = out["after"] - out["before"]
        assert grew <= 0.01 * out["weights"], f"serving grew RSS by {grew} bytes for {nbytes} of weights"
        ident = SourceIdentity(model="rss", revision="r", dtype="float32", fingerprint="f" * 64)
        dest = {f"layer{i}.weight": torch.zeros(nbytes // 8 // 4) for i in range(8)}
        result = pull_into(
            identity=ident, planner_url=planner, tensors=dest, options=opts(become_seed=False), **AUTH
        )
        assert result.source == "rfork-tcp"
        assert result.verified
        assert all(bool((t == float(i)).all()) for i, t in enumerate(dest.values()))
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# ---------------------------------------------------------------- the GPU paths, with host tensors


def test_host_mirrors_hold_each_regions_bytes():
    backing = torch.arange(4096, dtype=torch.int32)
    tensors = {"a": backing[:1000], "b": backing[1000:3000], "tied": backing[:1000], "c": torch.ones(7)}
    w = RankWeights.from_tensors(tensors=tensors)
    mirrors = w.host_mirrors()
    assert [m.numel() for m in mirrors] == list(w.layout.region_sizes)
    for p in w.layout.placements:
        got = mirrors[p.region][p.offset : p.offset + p.nbytes]
        assert torch.equal(got, tensors[p.name].reshape(-1).view(torch.uint8)), p.name
    assert mirrors[0].data_ptr() != backing.data_ptr()  # a copy (only GPU weights on tcp need one)


@pytest.mark.slow
def test_staged_pull_path_used_for_gpu_destinations_runs_with_host_tensors(planner):
    """The bounce-slot path GPU destinations take (tcp/shm cannot register device memory), run here
    with host tensors standing in for device memory; then the loaded instance serves."""
    model = tied_model(0)
    ident = identity_for(model)
    with Seed(
        weights=[RankWeights.from_tensors(tensors=model.state_dict())],
        identity=ident,
        planner_url=planner,
        token=REGISTER,
    ) as seed:
        target = tied_model(2)
        loader = Loader(identity=ident, planner_url=planner, options=opts(staged_reads=True), **AUTH)
        a = loader.load_into(target)
        try:
            assert a.source == "rfork-tcp"
            assert a.verified
            for name, t in model.state_dict().items():
                assert torch.equal(target.state_dict()[name], t), name
            assert a.seed is not None  # registered afresh after a staged pull
            third = {n: torch.empty_like(t) for n, t in model.state_dict().items()}
            b = pull_into(
                identity=ident,
                planner_url=planner,
                tensors=third,
                options=opts(exclude=seed.instance_ids, become_seed=False),
                **AUTH,
            )
            assert b.attempts[0].instance_id == a.seed.instance_ids[0]
            assert all(torch.equal(third[n], t) for n, t in model.state_dict().items())
            b.close()
        finally:
            a.close()
