"""One-sided pulls whose digests the transport's native core computes as reads land
(`LoadOptions.native_digests`, backends.DigestJob): from a seed in another process, with the Python
verifier thread made to fail so that only the native path can verify; and a seed serving bytes that
differ from its manifest is caught by the native digests, and the load falls back to disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch

from backends import native_digests_available
from bench.processes import available_providers
from rfork import Loader, LoadOptions, pull_into
from rfork.pull.one_sided import _ReadPipeline
from rfork.weights.checkpoint import CheckpointInfo, load_state_dict, read_checkpoint_info
from tests.rfork.conftest import AUTH, LOAD, REGISTER, assert_same, opts, start_seed, tied_model, tied_seed

pytestmark = pytest.mark.skipif(not native_digests_available(), reason="binding built without xxHash")


@pytest.fixture(autouse=True)
def xxh3_fleet(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native digests are xxh3-128: the setting of a trusted fleet (every process, seeds included)."""
    monkeypatch.setenv("RFORK_DIGEST", "xxh3-128")


def _no_python_verifier(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: Any, **_k: Any) -> NoReturn:
        raise AssertionError("the Python verifier thread ran")

    monkeypatch.setattr(_ReadPipeline, "_verify_upto", refuse)


Tensors = dict[str, torch.Tensor]


def _checkpoint_and_zeros(ckpt: Path) -> tuple[CheckpointInfo, Tensors, Tensors]:
    """The checkpoint's info, its tensors, and a zeroed destination of the same shapes."""
    expected = load_state_dict(ckpt)
    return read_checkpoint_info(ckpt), expected, {name: torch.zeros_like(t) for name, t in expected.items()}


@pytest.mark.slow
@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_pull_from_a_seed_process_verifies_through_native_digests(
    fleet, medium_ckpt, planner, provider, monkeypatch
) -> None:
    if not available_providers([provider])[0]:
        pytest.skip(f"{provider} is not available here")
    _no_python_verifier(monkeypatch)
    start_seed(fleet, medium_ckpt, planner, providers=[provider])
    info, expected, dest = _checkpoint_and_zeros(medium_ckpt)
    loader = Loader(
        identity=info.identity(),
        planner_url=planner,
        token=LOAD,
        register_token=REGISTER,
        # 1 MiB reads, 2 domains: many reads, chunks completing on two core threads
        options=LoadOptions(
            providers=[provider], domains=2, chunk_bytes=1 << 20, transfer_timeout_s=5.0,
            rank_deadline_s=60.0, become_seed=False,
        ),
    )
    result = loader.pull_into(dest)
    try:
        assert result.source == f"rfork-{provider}"
        assert result.verified
        assert [a.ok for a in result.attempts] == [True]
        assert_same(dest, expected)
        assert result.phases["verify"] > 0.0  # the job thread's hashing time
    finally:
        result.close()


@pytest.mark.slow
def test_bytes_that_differ_from_the_manifest_fail_the_native_digests(
    fleet, medium_ckpt, planner, monkeypatch
) -> None:
    _no_python_verifier(monkeypatch)
    ready = fleet.workdir / "changed.ready.json"
    a = fleet.spawn(
        "seed-changed", [str(medium_ckpt), planner, str(ready), "tcp"], module="tests.rfork.pull.changed_seed"
    )
    fleet.wait_file(a, ready, timeout_s=90)
    info, expected, dest = _checkpoint_and_zeros(medium_ckpt)
    result = pull_into(
        identity=info.identity(),
        planner_url=planner,
        tensors=dest,
        checkpoint=medium_ckpt,
        options=opts(become_seed=False),
        **AUTH,
    )
    try:
        assert result.source == "disk"
        assert "checksum" in (result.attempts[0].error or "")
        assert_same(dest, expected)
    finally:
        result.close()


@pytest.mark.parametrize("native", [True, False])
def test_tied_and_empty_tensors_verify_on_either_path(planner, monkeypatch, native: bool) -> None:
    """In one process (the seed's engine a peer of the loader's): tied names, a zero-byte buffer."""
    if native:
        _no_python_verifier(monkeypatch)
    with tied_seed(planner) as (model, ident, _seed):
        target = tied_model(3)
        result = pull_into(
            identity=ident,
            planner_url=planner,
            tensors=dict(target.state_dict()),
            options=opts(native_digests=native, become_seed=False, chunk_bytes=64 << 10),
            **AUTH,
        )
        try:
            assert result.verified
            for name, t in model.state_dict().items():
                assert torch.equal(target.state_dict()[name], t), name
        finally:
            result.close()
