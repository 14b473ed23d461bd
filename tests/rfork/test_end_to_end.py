"""R-Fork end to end: real seed processes, a real planner (SQLite; PostgreSQL once), real tcp transport."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.processes import load_args
from rfork import Loader, load
from rfork.errors import LoadFailed
from rfork.seed.seed import Seed
from rfork.weights.checkpoint import load_rank_from_disk, load_state_dict, read_checkpoint_info
from rfork.weights.rank_weights import RankWeights
from rfork.weights.synthetic import write_synthetic_checkpoint
from tests.rfork.conftest import (
    ADMIN,
    AUTH,
    LOAD,
    REGISTER,
    SMALL,
    assert_same,
    identity_of,
    opts,
    start_seed,
)
from tests.tiny_llama import LlamaForCausalLM

pytestmark = pytest.mark.slow


def test_seed_process_to_loaded_model_bit_identical_then_drains_on_sigterm(fleet, small_ckpt, planner):
    from planner.contract import PlannerClient

    ids, seed = start_seed(fleet, small_ckpt, planner)
    ident = identity_of(small_ckpt)
    result = load(identity=ident, planner_url=planner, **AUTH, options=opts(become_seed=False))
    try:
        assert result.source == "rfork-tcp"
        assert result.verified
        assert result.attempts[0].instance_id == ids[0]
        loaded = LlamaForCausalLM(SMALL)
        result.assign_to(loaded)
        reference = LlamaForCausalLM(SMALL)
        reference.load_state_dict(load_state_dict(small_ckpt), assign=True)
        ids_in = torch.randint(0, SMALL.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(loaded(ids_in), reference(ids_in))
    finally:
        result.close()
    with PlannerClient(planner, token=ADMIN) as client:
        transfers = client.transfers().items
        assert [t.outcome for t in transfers] == ["success"]
        assert fleet.stop(seed) == 0
        assert client.list_instances().total == 0  # drained and deregistered


def test_in_process_seed_from_module_zero_byte_and_loaded_instance_serves(tmp_path, planner):
    model = LlamaForCausalLM(SMALL)
    model.register_buffer("empty_buf", torch.empty(0, 8))
    weights = RankWeights.from_tensors(tensors=model.state_dict())  # served in place, no copy
    assert (
        model.model.embed_tokens.weight.data_ptr() == weights.tensors["model.embed_tokens.weight"].data_ptr()
    )
    from rfork.identity import SourceIdentity, fingerprint

    ident = SourceIdentity(
        model="module-test",
        revision="r1",
        dtype="bfloat16",
        fingerprint=fingerprint((n, str(t.dtype), t.shape) for n, t in model.state_dict().items()),
    )
    with Seed(
        weights=[weights], identity=ident, planner_url=planner, providers=["tcp"], token=REGISTER
    ) as seed:
        a = load(identity=ident, planner_url=planner, **AUTH, options=opts())
        try:
            assert a.state_dict()["empty_buf"].shape == (0, 8)
            assert_same(a.state_dict(), dict(model.state_dict()))
            b = load(
                identity=ident,
                planner_url=planner,
                token=LOAD,
                register_token=REGISTER,
                options=opts(exclude=seed.instance_ids, become_seed=False),
            )
            assert a.seed is not None
            assert b.attempts[0].instance_id == a.seed.instance_ids[0]  # served by the loaded instance
            assert_same(b.state_dict(), dict(model.state_dict()))
            b.close()
        finally:
            a.close()


def test_chain_seed_to_a_to_b(fleet, small_ckpt, planner):
    seed_ids, _ = start_seed(fleet, small_ckpt, planner)
    a_json = fleet.workdir / "a.json"
    a = fleet.spawn(
        "instance-a",
        load_args(
            a_json,
            planner_url=planner,
            checkpoint_id=read_checkpoint_info(small_ckpt).model_name,
            then="serve",
        ),
    )
    a_out = fleet.wait_file(a, a_json, timeout_s=90)
    assert a_out["source"] == "rfork-tcp"
    assert a_out["attempts"][0]["instance_id"] == seed_ids[0]
    ident = identity_of(small_ckpt)
    b = load(identity=ident, planner_url=planner, **AUTH, options=opts(exclude=seed_ids, become_seed=False))
    try:
        assert b.source == "rfork-tcp"
        assert b.attempts[0].instance_id == a_out["instance_ids"][0]
        assert_same(b.state_dict(), load_state_dict(small_ckpt))
    finally:
        b.close()


def test_tp2_seed_processes_and_loader(fleet, small_ckpt, planner):
    start_seed(fleet, small_ckpt, planner, tp=2)
    ident = identity_of(small_ckpt, tp=2)
    result = load(identity=ident, planner_url=planner, **AUTH, options=opts(become_seed=False))
    try:
        assert sorted(result.weights) == [0, 1]
        for rank in (0, 1):
            assert_same(result.state_dict(rank), load_state_dict(small_ckpt, tp=2, rank=rank))
        assert {a.source for a in result.attempts} == {"rfork-tcp"}
    finally:
        result.close()


class KillFirstSeed(Loader):
    """Kills the seed it is pulling from as soon as the first bytes arrive (once)."""

    def __init__(self, *, pids: dict[str, int], **kw):
        super().__init__(progress=self._on_progress, **kw)
        self.pids = pids
        self.current: str | None = None
        self.killed: str | None = None

    def _pull(self, source: Any, *args: Any, **kwargs: Any) -> Any:
        self.current = source.instance_id
        return super()._pull(source, *args, **kwargs)

    def _on_progress(self, done: int, total: int) -> None:
        if self.killed is None and 0 < done < total and self.current is not None:
            self.killed = self.current
            os.kill(self.pids[self.current], signal.SIGKILL)


def test_failover_when_seed_killed_mid_transfer(fleet, medium_ckpt, planner):
    from planner.contract import PlannerClient

    ids1, s1 = start_seed(fleet, medium_ckpt, planner, name="seed1")
    ids2, s2 = start_seed(fleet, medium_ckpt, planner, name="seed2")
    pids = {ids1[0]: s1.proc.pid, ids2[0]: s2.proc.pid}
    loader = KillFirstSeed(
        pids=pids,
        identity=identity_of(medium_ckpt),
        planner_url=planner,
        token=LOAD,
        options=opts(chunk_bytes=1 << 20, max_inflight=2, become_seed=False),
    )
    result = loader.load()
    try:
        assert loader.killed is not None
        assert [a.ok for a in result.attempts] == [False, True]
        assert result.attempts[0].instance_id == loader.killed
        assert result.attempts[1].instance_id != loader.killed
        assert result.source == "rfork-tcp"
        assert_same(result.state_dict(), load_state_dict(medium_ckpt))
    finally:
        result.close()
    with PlannerClient(planner, token=ADMIN) as client:
        outcomes = sorted(str(t.outcome) for t in client.transfers().items)
        assert outcomes == ["failure", "success"]


def test_disk_fallback_when_no_seed(small_ckpt, planner):
    ident = identity_of(small_ckpt)
    result = load(
        identity=ident,
        planner_url=planner,
        token=LOAD,
        register_token=REGISTER,
        checkpoint=small_ckpt,
        options=opts(become_seed=False),
    )
    assert result.source == "disk"
    assert_same(result.state_dict(), load_state_dict(small_ckpt))
    with pytest.raises(LoadFailed):
        load(identity=ident, planner_url=planner, **AUTH, options=opts(become_seed=False))


@pytest.mark.parametrize("native_digests", [True, False], ids=["native", "verifier-thread"])
def test_corrupted_seed_byte_caught_then_disk(small_ckpt, planner, native_digests):
    """A seed serving a byte that differs from its manifest: the tensor's check fails, the seed is
    reported, the load falls back to disk; with native digests off the verifier thread digests."""
    from planner.contract import PlannerClient

    info = read_checkpoint_info(small_ckpt)
    layout, buffers, tensors = load_rank_from_disk(info)
    weights = RankWeights(rank=0, layout=layout, buffers=buffers, tensors=tensors)
    with Seed(
        weights=[weights], identity=info.identity(), planner_url=planner, control=False, token=REGISTER
    ) as seed:
        victim = layout.placements[5]
        buffers[victim.region][victim.offset + 3] ^= 0x10  # after the checksums were published
        result = load(
            identity=info.identity(),
            planner_url=planner,
            token=LOAD,
            register_token=REGISTER,
            checkpoint=small_ckpt,
            options=opts(become_seed=False, native_digests=native_digests),
        )
        assert result.source == "disk"
        assert not result.verified
        assert not result.attempts[0].ok
        assert "checksum" in (result.attempts[0].error or "")
        assert result.attempts[0].instance_id == seed.instance_ids[0]
        assert_same(result.state_dict(), load_state_dict(small_ckpt))
        with PlannerClient(planner, token=ADMIN) as client:
            reasons = [t.reason for t in client.transfers().items]
            assert reasons == ["checksum_mismatch"]


def test_corrupted_seed_byte_under_blake3_caught_without_a_crash():
    """The test above under RFORK_DIGEST=blake3, where the loader's verifier thread hashes: after the
    mismatch it must not feed a span from the wrong offset (a negative length, a segmentation fault
    of the hasher). In a child pytest, so that a crash fails this test instead of killing the run."""
    env = {**os.environ, "RFORK_DIGEST": "blake3", "PYTHONFAULTHANDLER": "1"}
    # the default options (native digests on): under BLAKE3 the verifier thread digests all the same
    target = f"{Path(__file__).resolve()}::test_corrupted_seed_byte_caught_then_disk[native]"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", target],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = f"{proc.stdout[-3000:]}\n{proc.stderr[:3000]}"  # (a crash report starts with its cause)
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{output}"
    assert "1 passed" in proc.stdout


def test_mismatched_identity_refused(small_ckpt, planner, tmp_path):
    from dataclasses import replace

    from planner.contract import PlannerClient

    info = read_checkpoint_info(small_ckpt)
    layout, buffers, tensors = load_rank_from_disk(info)
    weights = RankWeights(rank=0, layout=layout, buffers=buffers, tensors=tensors)
    ident = info.identity()
    with (
        Seed(weights=[weights], identity=ident, planner_url=planner, control=False, token=REGISTER),
        PlannerClient(planner, token=ADMIN) as c,
    ):
        for other in (
            ident.model_copy(update={"fingerprint": "0" * 64}),
            ident.model_copy(update={"tp": 2}),
            ident.model_copy(update={"revision": "x"}),
            ident.model_copy(update={"device_kind": "cuda:sm90"}),
        ):
            assert c.request_assignment(identity=other, rank=0, providers=["tcp"]) is None
        # a loader whose own checkpoint differs (one tensor reshaped) never reaches that seed
        other_dir = write_synthetic_checkpoint(tmp_path / "other", config=replace(SMALL, vocab_size=1024))
        result = load(
            identity=identity_of(other_dir),
            planner_url=planner,
            token=LOAD,
            register_token=REGISTER,
            checkpoint=other_dir,
            options=opts(become_seed=False),
        )
        assert result.source == "disk"
        assert result.attempts == [result.attempts[0]]
        assert result.attempts[0].source == "disk"


@pytest.mark.postgres
def test_end_to_end_on_postgresql(fleet, small_ckpt, postgres_url):
    from planner import PlannerServer

    with PlannerServer(db_url=postgres_url, insecure=True) as srv:
        ids, seed = start_seed(fleet, small_ckpt, srv.url)
        out = fleet.workdir / "pg.json"
        child = fleet.spawn("loader", load_args(out, planner_url=srv.url, checkpoint=small_ckpt))
        res = fleet.wait_file(child, out, timeout_s=90)
        assert fleet.wait_exit(child, timeout_s=30) == 0
        assert res["source"] == "rfork-tcp"
        assert res["verified"]
        assert res["attempts"][0]["instance_id"] == ids[0]
        assert fleet.stop(seed) == 0
