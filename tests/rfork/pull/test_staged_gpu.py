"""The staged pull on a GPU: a seed serving CUDA weights over tcp (a pinned host mirror, as tcp cannot
register device memory), a loader pulling into the framework's own CUDA tensors through pinned bounce
slots, verified by the device digest; the loader then serves them and a third instance pulls from it.
Skipped where CUDA is absent (tests/rfork/pull/test_one_sided.py runs the same path on host tensors).
"""

from __future__ import annotations

import pytest
import torch

from rfork import Loader, pull_into
from rfork.seed.seed import Seed
from rfork.weights import checksum as ck
from rfork.weights.rank_weights import RankWeights
from tests.rfork.conftest import AUTH, REGISTER, identity_for, opts, tied_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("digest", [ck.XXH3_128, ck.BLAKE3])
def test_gpu_weights_pulled_staged_over_tcp_then_served_again(
    planner: str, digest: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under either setting; with RFORK_DIGEST=blake3 the seed, the loader and the chained third pull
    hash the CUDA tensors with BLAKE3 on the device."""
    monkeypatch.setenv("RFORK_DIGEST", digest)
    model = tied_model(0).to(device="cuda", dtype=torch.bfloat16)
    ident = identity_for(model)
    served = RankWeights.from_tensors(tensors=model.state_dict())
    assert served.checksum_algorithm == (ck.BLAKE3 if digest == ck.BLAKE3 else ck.DEVICE_DIGEST)
    with Seed(weights=[served], identity=ident, planner_url=planner, token=REGISTER) as seed:
        target = tied_model(2).to(device="cuda", dtype=torch.bfloat16)
        a = Loader(identity=ident, planner_url=planner, options=opts(), **AUTH).load_into(target)
        try:
            assert a.source == "rfork-tcp"
            assert a.verified
            for name, t in model.state_dict().items():
                got = target.state_dict()[name]
                assert got.is_cuda, name
                assert torch.equal(got, t), name
            assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
            assert a.seed is not None  # the GPU weights are served again (a fresh host mirror)
            third = {n: torch.empty_like(t) for n, t in model.state_dict().items()}
            b = pull_into(identity=ident, planner_url=planner, tensors=third,
                          options=opts(exclude=seed.instance_ids, become_seed=False), **AUTH)
            try:
                assert b.attempts[0].instance_id == a.seed.instance_ids[0]
                assert b.verified
                assert all(torch.equal(third[n], t) for n, t in model.state_dict().items())
            finally:
                b.close()
        finally:
            a.close()
