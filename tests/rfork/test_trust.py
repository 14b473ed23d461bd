"""Anchored integrity end to end: a seed whose bytes changed after it published is never accepted, and
is quarantined.
"""

from __future__ import annotations

import urllib.error
import urllib.request

import httpx
import pytest

from planner.contract import Conflict, PlannerClient
from rfork import load
from rfork.errors import ConfigurationError, LoadFailed
from rfork.seed.seed import Seed
from rfork.weights.checkpoint import load_rank_from_disk, load_state_dict, read_checkpoint_info
from rfork.weights.rank_weights import RankWeights
from tests.rfork.conftest import ADMIN, AUTH, REGISTER, assert_same, opts
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def _weights(ckpt) -> RankWeights:
    layout, buffers, tensors = load_rank_from_disk(read_checkpoint_info(ckpt))
    return RankWeights(rank=0, layout=layout, buffers=buffers, tensors=tensors)


def test_flipped_byte_in_a_ready_seed_is_never_accepted_and_quarantines_it(small_ckpt, planner):
    info = read_checkpoint_info(small_ckpt)
    weights = _weights(small_ckpt)
    admin = PlannerClient(planner, token=ADMIN)
    with Seed(
        weights=[weights], identity=info.identity(), planner_url=planner, control=False, token=REGISTER
    ) as seed:
        victim = weights.layout.placements[7]
        weights.buffers[victim.region][victim.offset + 11] ^= 0x01  # one bit, while READY
        first = load(
            identity=info.identity(),
            planner_url=planner,
            checkpoint=small_ckpt,
            **AUTH,
            options=opts(become_seed=False),
        )
        assert first.source == "disk"  # the corrupt seed was refused, the disk copy verified
        assert first.attempts[0].instance_id == seed.instance_ids[0]
        assert "checksum" in (first.attempts[0].error or "")
        assert_same(first.state_dict(), load_state_dict(small_ckpt))
        view = admin.get_instance(seed.instance_ids[0])
        # out of service until it re-verifies (and its re-hash of the corrupted memory will fail)
        assert view.reverifying or view.integrity_failed
        with pytest.raises(LoadFailed):  # no loader is ever handed that seed again
            load(identity=info.identity(), planner_url=planner, **AUTH, options=opts(become_seed=False))
        # republishing from the corrupted memory is refused against the anchor
        pub = seed.publications[0]
        weights.checksums.clear()
        fresh = weights.manifest(seed.servers[0].ranks[0].descriptors()).model_dump()
        with pytest.raises(Conflict) as err:
            pub.client.put_manifest(seed.instance_ids[0], 0, {**fresh, "origin": "disk"})
        assert err.value.reason == "digest_mismatch"
        metrics = urllib.request.urlopen(planner + "/metrics", timeout=10).read().decode()
        assert "rfork_planner_integrity_refusals_total 1.0" in metrics


def test_a_refused_publication_never_fails_a_verified_load(small_ckpt, planner):
    """Issue #21: `_become_seed` sat outside any `try`, so a planner refusing the publication (here: a
    register token it does not know) made `load()` raise although every tensor had verified."""
    info = read_checkpoint_info(small_ckpt)
    with Seed(
        weights=[_weights(small_ckpt)],
        identity=info.identity(),
        planner_url=planner,
        control=False,
        token=REGISTER,
    ):
        result = load(
            identity=info.identity(),
            planner_url=planner,
            checkpoint=small_ckpt,
            token=AUTH["token"],
            register_token="not-a-token-this-planner-knows",
            options=opts(),
        )
        try:
            assert result.verified
            assert result.source != "disk"
            assert result.seed is None
            assert result.seed_error is not None
            assert "register" in result.seed_error or "token" in result.seed_error
            assert_same(result.state_dict(), load_state_dict(small_ckpt))
        finally:
            result.close()


def test_a_pull_verified_with_blake3(small_ckpt, planner, monkeypatch):
    """The whole fleet on RFORK_DIGEST=blake3: the seed publishes BLAKE3 digests, the identity is anchored
    with them, the loader verifies every tensor with BLAKE3 as it lands."""
    monkeypatch.setenv("RFORK_DIGEST", "blake3")
    info = read_checkpoint_info(small_ckpt)
    with Seed(
        weights=[_weights(small_ckpt)],
        identity=info.identity(),
        planner_url=planner,
        control=False,
        token=REGISTER,
    ):
        result = load(identity=info.identity(), planner_url=planner, **AUTH, options=opts(become_seed=False))
        assert result.verified
        assert result.source == "rfork-tcp"
        assert_same(result.state_dict(), load_state_dict(small_ckpt))
        admin = {"Authorization": f"Bearer {ADMIN}"}
        anchors = httpx.get(f"{planner}/v1/anchors", headers=admin).json()["items"]
        assert [a["checksum_algorithm"] for a in anchors] == ["blake3"]


@pytest.mark.parametrize("digest", ["xxh3-128", "blake3"])
def test_a_loader_that_requires_a_cryptographic_digest_pulls_only_under_blake3(
    small_ckpt, planner, monkeypatch, digest
):
    """require_crypto_digest: under xxh3-128 the load stops with a ConfigurationError naming the setting
    before any source is read (no disk fallback); under BLAKE3 it pulls from the seed as usual."""
    monkeypatch.setenv("RFORK_DIGEST", digest)
    info = read_checkpoint_info(small_ckpt)
    ident = info.identity()
    weights = [_weights(small_ckpt)]
    with Seed(weights=weights, identity=ident, planner_url=planner, control=False, token=REGISTER):
        strict = opts(become_seed=False, require_crypto_digest=True)
        if digest == "xxh3-128":
            with pytest.raises(ConfigurationError, match="xxh3-128, which is not cryptographic") as err:
                load(identity=ident, planner_url=planner, checkpoint=small_ckpt, **AUTH, options=strict)
            assert err.value.setting == "require_crypto_digest"
            return
        result = load(identity=ident, planner_url=planner, **AUTH, options=strict)
        assert result.verified
        assert result.source == "rfork-tcp"
        result.close()


def test_a_false_checksum_report_costs_a_healthy_seed_one_reverification(small_ckpt, sqlite_url):
    """A loader claims checksum_mismatch against a healthy seed: the seed is offered to nobody, its
    heartbeat answer says reverify, it re-hashes its memory and republishes, and it is offered again in
    seconds (not after quarantine_s); the claim counts as disproved against the reporter."""
    from planner import PlannerServer

    info = read_checkpoint_info(small_ckpt)
    with PlannerServer(
        db_url=sqlite_url,
        admin_token=ADMIN,
        register_token=REGISTER,
        anchor_token=REGISTER,
        load_token=AUTH["token"],
        heartbeat_ttl_s=1.5,  # the seed beats every 0.5 s
        quarantine_s=3600,
        reaper_interval_s=3600,
    ) as srv:
        admin = PlannerClient(srv.url, token=ADMIN)
        liar = PlannerClient(srv.url, token=AUTH["token"])
        with Seed(
            weights=[_weights(small_ckpt)],
            identity=info.identity(),
            planner_url=srv.url,
            control=False,
            token=REGISTER,
        ) as seed:
            lease = liar.request_assignment(identity=info.identity(), rank=0)
            assert lease is not None
            liar.report_transfer(lease.id, outcome="failure", reason="checksum_mismatch", error="made up")
            assert admin.get_instance(seed.instance_ids[0]).reverifying
            wait_until(
                lambda: not admin.get_instance(seed.instance_ids[0]).reverifying,
                30,
                "the seed re-verified",
                every_s=0.2,
            )
            view = admin.get_instance(seed.instance_ids[0])
            assert not view.reverifying
            assert not view.integrity_failed
            assert liar.request_assignment(identity=info.identity(), rank=0) is not None  # back in service
