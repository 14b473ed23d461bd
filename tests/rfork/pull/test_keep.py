"""Rollouts (`LoadOptions(keep_matching=True)`): an instance holding another version of the model reads
only the tensors whose bytes differ from the seed's anchored digests, keeps the rest verified by their
own digest, and serves the whole result as a seed of the new version.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from rfork import pull_into
from rfork.pull import keep
from rfork.pull.keep import _overlapping, split_matching
from rfork.weights.checkpoint import load_state_dict
from rfork.weights.rank_weights import RankWeights
from tests.rfork.conftest import AUTH, assert_same, identity_of, opts, start_seed, tied_model


def _older(new: dict[str, torch.Tensor], changed: list[str]) -> dict[str, torch.Tensor]:
    """A copy of `new` in which the `changed` tensors hold other values (the version before)."""
    old = {n: t.clone() for n, t in new.items()}
    for n in changed:
        old[n].add_(1)
    return old


def test_split_keeps_what_matches_reads_the_rest_and_counts_tied_bytes_once():
    model = tied_model(0)
    new = RankWeights.from_tensors(tensors=model.state_dict())
    manifest = new.manifest([b""] * len(new.layout.region_sizes))
    changed = ["model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight"]  # the second is tied
    old_model = tied_model(0)
    with torch.no_grad():
        for name in changed:
            old_model.state_dict()[name].add_(1)
    dest = RankWeights.from_tensors(tensors=old_model.state_dict())
    split = split_matching(dest, manifest)
    assert split.to_read is not None
    assert set(split.to_read.tensors) == {*changed, "lm_head.weight"}  # tied names travel together
    assert {t.name for t in split.manifest.tensors} == set(split.to_read.tensors)
    sizes = {n: t.numel() * t.element_size() for n, t in model.state_dict().items()}
    assert split.read_bytes == sizes[changed[0]] + sizes[changed[1]]
    assert split.kept_bytes + split.read_bytes == sum(new.layout.region_sizes)  # distinct bytes
    kept = {t.name: t.checksum for t in manifest.tensors if t.name not in split.to_read.tensors}
    assert dest.checksums == kept  # every kept tensor, the zero-byte buffer included, with its digest
    # the tensors to read are the destination's own memory: a read fills the caller's tensors
    for name, t in split.to_read.tensors.items():
        assert t.data_ptr() == old_model.state_dict()[name].data_ptr()


def test_split_of_an_identical_destination_reads_nothing():
    model = tied_model(0)
    weights = RankWeights.from_tensors(tensors=model.state_dict())
    manifest = weights.manifest([b""] * len(weights.layout.region_sizes))
    split = split_matching(RankWeights.from_tensors(tensors=tied_model(0).state_dict()), manifest)
    assert split.to_read is None
    assert split.read_bytes == 0
    assert split.kept_bytes == sum(weights.layout.region_sizes)


def test_held_digests_are_trusted_instead_of_hashing(monkeypatch):
    model = tied_model(0)
    new = RankWeights.from_tensors(tensors=model.state_dict())
    manifest = new.manifest([b""] * len(new.layout.region_sizes))
    old = tied_model(0)
    with torch.no_grad():
        old.state_dict()["model.norm.weight"].add_(1)
    dest = RankWeights.from_tensors(tensors=old.state_dict())
    held = RankWeights.from_tensors(tensors=old.state_dict()).compute_checksums()
    hashed: list[int] = []
    real = keep._digest_all

    def counting(tensors: list[torch.Tensor]) -> list[str]:
        hashed.append(len(tensors))
        return real(tensors)

    monkeypatch.setattr(keep, "_digest_all", counting)
    split = keep.split_matching(dest, manifest, held)
    assert hashed == [0]
    assert split.to_read is not None
    assert set(split.to_read.tensors) == {"model.norm.weight"}


def test_a_tensor_that_overlaps_another_is_read_even_when_it_matches():
    base = torch.arange(64, dtype=torch.float32)
    tensors = {"whole": base, "head": base[:16], "apart": torch.ones(8)}
    weights = RankWeights.from_tensors(tensors=tensors)
    manifest = weights.manifest([b""] * len(weights.layout.region_sizes))
    split = split_matching(RankWeights.from_tensors(tensors=tensors), manifest)
    assert split.to_read is not None
    assert set(split.to_read.tensors) == {"whole", "head"}  # writing one would change the other
    assert split.kept_bytes == 32


@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 50), st.integers(1, 20)), max_size=12))
def test_overlapping_finds_exactly_the_spans_that_share_a_byte(spans):
    spans = list(dict.fromkeys(spans))

    def share(a, b):
        return a[0] == b[0] and a[1] < b[1] + b[2] and b[1] < a[1] + a[2]

    want = {a for a in spans for b in spans if a != b and share(a, b)}
    assert _overlapping(spans) == want


@pytest.mark.slow
def test_a_rollout_reads_only_changed_tensors_from_a_seed_process_then_serves_the_new_version(
    planner, fleet, small_ckpt
):
    start_seed(fleet, small_ckpt, planner)  # v2, in its own process
    ident = identity_of(small_ckpt)
    v2 = load_state_dict(small_ckpt)
    names = sorted(v2)
    changed = names[::10]  # one tensor in ten differs in the version this instance holds
    dest = _older(v2, changed)
    ptrs = {n: t.data_ptr() for n, t in dest.items()}
    result = pull_into(
        identity=ident, planner_url=planner, tensors=dest, options=opts(keep_matching=True), **AUTH
    )
    try:
        assert result.verified
        assert result.source == "rfork-tcp"
        assert result.bytes == sum(v2[n].nbytes for n in changed)
        assert result.bytes + result.kept_bytes == sum(t.nbytes for t in v2.values())
        assert "keep" in result.attempts[-1].phases
        assert_same(dest, v2)
        assert {n: t.data_ptr() for n, t in dest.items()} == ptrs  # in place
        # it serves v2 whole: a fresh instance pulls every tensor from it, verified
        assert result.seed is not None
        fresh = {n: torch.zeros_like(t) for n, t in v2.items()}
        again = pull_into(
            identity=ident,
            planner_url=planner,
            tensors=fresh,
            options=opts(keep_matching=True, become_seed=False, exclude=_seed_processes(result)),
            **AUTH,
        )
        assert again.attempts[-1].instance_id == result.seed.instance_ids[0]
        assert again.verified
        assert_same(fresh, v2)
        nonzero = sum(t.nbytes for t in v2.values() if bool(t.any()))
        assert again.bytes >= nonzero  # a zero destination keeps only all-zero tensors
        again.close()
    finally:
        result.close()


@pytest.mark.slow
def test_a_fresh_instance_reads_shared_tensors_from_the_previous_versions_seed(
    planner, fleet, small_ckpt, tmp_path
):
    """v2 differs from v1 in one tensor in ten: a destination holding neither reads those from the v2
    seed and the rest from the v1 seed (the planner finds it through equal anchored digests), all
    verified; with the v1 seed dead it reads everything from v2."""
    v1 = load_state_dict(small_ckpt)
    changed = sorted(v1)[::10]
    v2 = _older(v1, changed)  # "older" here: other values in `changed`, the rest shared
    v2_dir = tmp_path / "v2"
    v2_dir.mkdir()
    save_file({n: t.contiguous() for n, t in v2.items()}, str(v2_dir / "model.safetensors"))
    shutil.copy(small_ckpt / "config.json", v2_dir / "config.json")
    _, v1_seed = start_seed(fleet, small_ckpt, planner, "v1", extra=["--revision", "v1"])
    start_seed(fleet, v2_dir, planner, "v2", extra=["--revision", "v2"])
    ident = identity_of(v2_dir).model_copy(update={"revision": "v2"})
    changed_bytes = sum(v2[n].nbytes for n in changed)
    total = sum(t.nbytes for t in v2.values())
    for v1_alive in (True, False):
        dest = {n: torch.zeros_like(t) for n, t in v2.items()}
        result = pull_into(
            identity=ident,
            planner_url=planner,
            tensors=dest,
            options=opts(keep_matching=True, become_seed=False),
            **AUTH,
        )
        assert result.verified
        assert_same(dest, v2)
        assert result.bytes + result.kept_bytes == total
        by_identity = [(a.ok, a.bytes) for a in result.attempts if a.ok]
        if v1_alive:
            assert by_identity[-1] == (True, changed_bytes)  # from the v2 seed: only what changed
            assert sum(b for _, b in by_identity[:-1]) == result.bytes - changed_bytes  # the v1 seed's
            fleet.kill(v1_seed)  # still READY at the planner: the next loader meets a dead seed
        else:
            assert by_identity == [(True, result.bytes)]  # all from v2
            failed = [a for a in result.attempts if not a.ok]  # the dead v1 seed's, listed with why
            assert len(failed) == 1
            assert failed[0].error
            assert failed[0].bytes == 0
        result.close()


def _seed_processes(result) -> list[str]:
    """The instances `result` pulled from (to steer the next pull to the instance it became)."""
    return [a.instance_id for a in result.attempts if a.instance_id]
