"""rfork.pull.one_sided: the read plan, and the staged path for GPU destinations (run with host
tensors here).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.contract import RankManifest, RegionEntry, TensorEntry
from rfork import Loader, pull_into
from rfork.errors import ChecksumMismatch, PullError
from rfork.pull.one_sided import _ReadPipeline
from rfork.pull.read_plan import ReadPlan
from rfork.weights import checksum as ck
from rfork.weights.rank_weights import RankWeights
from tests.rfork.conftest import AUTH, opts, tied_model, tied_seed

# A few backing buffers; tensors are byte spans carved out of them (they may overlap or repeat).
spans_strategy = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 300), st.integers(0, 120)), min_size=1, max_size=25
)


def carve(spans: list[tuple[int, int, int]]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    backing = [torch.arange(512, dtype=torch.int64).to(torch.uint8) + i for i in range(3)]
    tensors = {f"t{i}": backing[b][off : off + n] for i, (b, off, n) in enumerate(spans)}
    return backing, tensors


def _source_value(entries: list[TensorEntry], tensors: dict[str, torch.Tensor], src_off: int) -> int:
    for e in entries:
        if e.offset <= src_off < e.offset + e.nbytes:
            return int(tensors[e.name].reshape(-1)[src_off - e.offset])
    raise AssertionError(src_off)


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
                name=p.name,
                dtype=p.dtype,
                shape=list(p.shape),
                nbytes=p.nbytes,
                region=0,
                offset=off,
                checksum="",
            )
        )
        off += p.nbytes
    manifest = RankManifest(
        rank=0,
        checksum_algorithm=ck.algorithm_for("cpu"),
        regions=[RegionEntry(index=0, nbytes=off, descriptor="")],
        tensors=entries,
    )
    plan = ReadPlan.check(manifest, dest).reads(chunk_bytes=16)
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


def _verifier(monkeypatch: pytest.MonkeyPatch, algorithm: str, wrong: str = "") -> _ReadPipeline:
    """A read pipeline's verifier over three tensors a, b, c, one after another in one host region
    (bytes 0-64, 64-128, 128-256); the manifest's digest of `wrong` does not match."""
    monkeypatch.setenv("RFORK_DIGEST", algorithm)
    backing = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    tensors = {"a": backing[:64], "b": backing[64:128], "c": backing[128:]}
    dest = RankWeights.from_tensors(tensors=tensors)
    assert [(p.name, p.offset, p.nbytes) for p in dest.layout.placements] == [
        ("a", 0, 64), ("b", 64, 64), ("c", 128, 128)
    ]
    entries = [
        TensorEntry(
            name=p.name, dtype=p.dtype, shape=list(p.shape), nbytes=p.nbytes, region=0, offset=p.offset,
            checksum="0" * 32 if p.name == wrong else ck.tensor_checksum(tensors[p.name]),
        )
        for p in dest.layout.placements
    ]
    manifest = RankManifest(
        rank=0, checksum_algorithm=algorithm, regions=[RegionEntry(index=0, nbytes=256, descriptor="")],
        tensors=entries,
    )
    plan = ReadPlan.check(manifest, dest)
    return _ReadPipeline(None, plan, opts(), deadline=0.0, progress=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("algorithm", ck.HOST_ALGORITHMS)
def test_verifier_after_a_mismatch_hashes_nothing_more(monkeypatch, algorithm):
    # a fails its check in the first call, so b (ending by 160 too) is never fed; the second call
    # used to feed b from offset 160, past its end: a negative length, a crash in the hasher
    pipe = _verifier(monkeypatch, algorithm, wrong="a")
    with pytest.raises(ChecksumMismatch, match="'a'"):
        pipe._verify_upto(0, 0, 160)
    pipe._verify_upto(0, 160, 256)
    assert pipe.dest.checksums == {}


@pytest.mark.parametrize("algorithm", ck.HOST_ALGORITHMS)
def test_verifier_refuses_bytes_out_of_step(monkeypatch, algorithm):
    pipe = _verifier(monkeypatch, algorithm)
    pipe._verify_upto(0, 0, 100)
    with pytest.raises(PullError, match="out of step"):
        pipe._verify_upto(0, 120, 256)  # bytes 100-120 were never fed
    pipe._verify_upto(0, 100, 256)  # and nothing more after that
    assert set(pipe.dest.checksums) == {"a"}
    pipe = _verifier(monkeypatch, algorithm)
    pipe._verify_upto(0, 0, 100)
    pipe._verify_upto(0, 100, 256)
    assert set(pipe.dest.checksums) == {"a", "b", "c"}


@pytest.mark.slow
def test_staged_pull_path_used_for_gpu_destinations_runs_with_host_tensors(planner):
    """The bounce-slot path GPU destinations take (tcp/shm cannot register device memory), run here
    with host tensors standing in for device memory; then the loaded instance serves."""
    with tied_seed(planner) as (model, ident, seed):
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


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("max_inflight", [1, 3, 8])
def test_reads_go_to_the_engine_as_ops_within_the_window(planner, monkeypatch, native, max_inflight) -> None:
    """The pull hands the engine ops of several reads, at most max_inflight // 2 (at least 1) read
    slots each (a read of chunk_bytes is one slot, a smaller one its share, at least 1/64), and never
    has more than max_inflight slots submitted and unfinished; every byte still arrives and verifies,
    on the native digest path and on the Python verifier's (which needs each op's reads marked done)."""
    from backends import TransferEngine
    from rfork.pull.one_sided import SMALL_READS_PER_SLOT

    chunk = 16 << 10
    ops: list[float] = []
    reads_per_op: list[int] = []
    outstanding: list[tuple[Any, float]] = []
    most = 0.0
    start_op = TransferEngine.start_op

    def counting_start_op(self: TransferEngine, name: str, parts: Any) -> Any:
        nonlocal most
        op = start_op(self, name, parts)
        if name == "read":
            slots = sum(max(p.spans[0][2] / chunk, 1 / SMALL_READS_PER_SLOT) for p in parts)
            outstanding[:] = [(f, n) for f, n in outstanding if not f.done()]
            outstanding.append((op.future, slots))
            most = max(most, sum(n for _f, n in outstanding))
            ops.append(slots)
            reads_per_op.append(len(parts))
        return op

    monkeypatch.setattr(TransferEngine, "start_op", counting_start_op)
    with tied_seed(planner) as (model, ident, _seed):
        target = tied_model(5)
        result = pull_into(
            identity=ident,
            planner_url=planner,
            tensors=dict(target.state_dict()),
            options=opts(
                native_digests=native, become_seed=False, chunk_bytes=chunk, max_inflight=max_inflight
            ),
            **AUTH,
        )
        try:
            assert result.verified
            for name, t in model.state_dict().items():
                assert torch.equal(target.state_dict()[name], t), name
        finally:
            result.close()
    assert len(ops) > 2, ops
    assert max(ops) <= max(1, max_inflight // 2) + 1e-9, ops
    if max_inflight >= 4:  # several reads per op: Python wakes once per op, not once per read
        assert max(reads_per_op) > 1, reads_per_op
    assert most <= max_inflight + 1e-9, most
