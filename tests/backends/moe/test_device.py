"""MoE dispatch/combine with device tokens and outputs (backends.moe.device), real tcp engines.

Three ranks in this process, exact against the single-process reference for bf16 and fp8 wires,
over rounds with varying token counts. "cpu" stands in for the device here; "cuda" is marked gpu.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import pytest
import torch

from backends import TransferEngine
from backends.moe import MoEError
from backends.moe.device import DeviceExpertParallel
from tests.backends.gpu.devices import DEVICES
from tests.backends.moe.cases import Case, apply_expert, expert_tables, rank_inputs, reference

_groups = itertools.count()


@pytest.fixture(scope="module")
def engines() -> Iterator[list[TransferEngine]]:
    engs = [
        TransferEngine("tcp", 1, timeout_s=5.0, chunk_bytes=64 << 20, reorder_for_test=True, host="127.0.0.1")
        for _ in range(3)
    ]
    yield engs
    for e in engs:
        e.close()


def _group(engs: list[TransferEngine], case: Case, device: str) -> list[DeviceExpertParallel]:
    group = f"dev{next(_groups)}"
    eps = [DeviceExpertParallel(engs[r], device=device, rank=r, world_size=case.world,
                                num_experts=case.num_experts, hidden=case.hidden, topk=case.topk,
                                max_tokens=case.max_tokens, wire=case.wire, group=group, timeout_s=20.0)
           for r in range(case.world)]
    blobs = [ep.setup_blob() for ep in eps]
    threads = [threading.Thread(target=ep.connect, args=(blobs,)) for ep in eps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return eps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wire", ["bf16", "fp8"])
def test_device_rounds_match_the_reference(engines: list[TransferEngine], device: str, wire: str) -> None:
    case = Case(world=3, num_experts=6, hidden=64, topk=2, max_tokens=12, wire=wire, seed=5)
    eps = _group(engines, case, device)
    tables = expert_tables(case)
    try:
        for round_ in range(3):
            inputs = [rank_inputs(case, r, round_) for r in range(case.world)]
            for ep, (x, ids, _) in zip(eps, inputs, strict=True):
                ep.dispatch_send(x.to(device), ids.to(device))
            received = [ep.dispatch_recv() for ep in eps]
            for r, (ep, d) in enumerate(zip(eps, received, strict=True)):
                assert d.x.device.type == device
                assert d.out.device.type == device
                mine = (ep.expert_to_rank == r).nonzero().squeeze(1).tolist()
                for local, pairs in enumerate(d.expert_pairs()):
                    if pairs.numel():
                        d.out[pairs] = apply_expert(tables, mine[local], d.gather(pairs).cpu()).to(device)
                ep.combine_send(d)
            ys = [ep.combine_recv(w.to(device)) for ep, (_, _, w) in zip(eps, inputs, strict=True)]
            ref, ref_counts = reference(case, round_)
            assert [d.expert_counts() for d in received] == ref_counts
            for r, (y, want) in enumerate(zip(ys, ref, strict=True)):
                assert y.device.type == device
                assert torch.equal(y.cpu(), want), f"rank {r} round {round_} differs from the reference"
    finally:
        for ep in eps:
            ep.close()


def test_device_misuse_is_refused_and_leaves_the_group_usable(engines: list[TransferEngine]) -> None:
    case = Case(world=2, num_experts=4, hidden=16, topk=2, max_tokens=4)
    eps = _group(engines[:2], case, "cpu")
    try:
        x5, ids5 = torch.zeros(5, 16, dtype=torch.bfloat16), torch.zeros(5, 2, dtype=torch.int64)
        with pytest.raises(ValueError, match="exceed max_tokens"):
            eps[0].dispatch_send(x5, ids5)
        with pytest.raises(ValueError, match="must be bf16"):
            eps[0].dispatch_send(torch.zeros(2, 16), torch.zeros(2, 2, dtype=torch.int64))
        ids = torch.tensor([[0, 3], [1, 2]])
        for ep in eps:
            ep.dispatch_send(torch.ones(2, 16, dtype=torch.bfloat16), ids)
        ds = [ep.dispatch_recv() for ep in eps]
        with pytest.raises(ValueError, match="out must be"):
            eps[0].combine_send(ds[0], torch.zeros(1, 16, dtype=torch.bfloat16))
        for ep, d in zip(eps, ds, strict=True):
            d.out.copy_(d.gather(torch.arange(d.pair_row.numel())))
            ep.combine_send(d)
        ys = [ep.combine_recv(torch.full((2, 2), 0.5)) for ep in eps]
        assert all(bool((y == 1).all()) for y in ys)  # identity experts, weights summing to 1
        with pytest.raises(MoEError, match="combine_send called in state 'idle'"):
            eps[0].combine_send(ds[0])
    finally:
        for ep in eps:
            ep.close()
