"""/v1/compile-caches: a key is offered only once an authority anchored its archive digest, only from
READY instances of the key's identity whose manifests match their anchors, with one-fetch tokens bound
to the key."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from planner.contract import (
    AuthError,
    BadRequest,
    Conflict,
    NotFound,
    PlannerClient,
    control_token,
)
from planner.contract.wire import compile_cache_key, identity_key
from planner.server import PlannerServer
from tests.planner.conftest import identity, manifest, ranks
from tests.planner.test_auth import TOKENS

DIGEST, FORGED, GROWN = "sha256:" + "1" * 64, "sha256:" + "2" * 64, "sha256:" + "3" * 64
IDENT = identity()
IKEY = identity_key(IDENT)
# keys of IDENT (what a loader hashes besides the identity is the variant)
KEY, OTHER = (compile_cache_key(IKEY, v) for v in ("5" * 64, "6" * 64))
VARIANTS = {KEY: "5" * 64, OTHER: "6" * 64}
KV = VARIANTS[KEY]


def _serving(
    c: PlannerClient,
    *,
    node: str,
    ident: dict[str, Any] | None = None,
    keys: tuple[str, ...] = (KEY,),
    manifests: bool = True,
    ready: bool = True,
) -> tuple[Any, str]:
    """An instance serving `keys`, with its rank-0 manifest published (from disk) and READY."""
    key = control_token.new_control_key()
    reg = c.register_instance(
        identity=ident or IDENT,
        labels={"node": node},
        ranks=ranks(0),
        control_url=f"http://{node}:9",
        control_key=key,
        compile_cache_keys=keys,
    )
    own = c.with_token(reg.token) if reg.token else c
    if manifests:
        own.put_manifest(reg.id, 0, manifest(0))
    if ready:
        own.set_status(reg.id, "READY")
    return reg, key


@pytest.fixture
def secure(planner_url: str) -> Iterator[PlannerServer]:
    with PlannerServer(db_url=planner_url, port=0, insecure=False, reaper_interval_s=3600, **TOKENS) as srv:
        yield srv


def test_ready_instances_of_the_anchored_identity_come_with_a_one_key_token(server: PlannerServer) -> None:
    c = PlannerClient(server.url)
    far, _ = _serving(c, node="n2", ready=False)
    near, near_key = _serving(c, node="n1", ready=False)
    assert near.compile_cache_keys == [KEY]
    with pytest.raises(NotFound) as nothing:
        c.compile_cache_sources(KEY, identity_key=IKEY)  # no authority set its digest: nothing to fetch
    assert nothing.value.reason == "not_anchored"
    c.anchor_compile_cache(KEY, DIGEST, key_variant=KV, identity_key=identity_key(IDENT))
    assert c.compile_cache_sources(KEY, identity_key=IKEY) is None  # INITIALIZING: not yet
    c.set_status(far.id, "READY")
    c.set_status(near.id, "READY")
    found = c.compile_cache_sources(KEY, identity_key=IKEY, labels={"node": "n1"})
    assert found is not None
    assert found.archive_digest == DIGEST
    assert [s.instance_id for s in found.sources] == [near.id, far.id]  # same node first
    assert found.sources[0].control_url == "http://n1:9"
    grant = control_token.verify_control_token(
        found.sources[0].control_token, near_key, instance_ids=[near.id], rank=0, now=time.time()
    )
    assert grant.compile_cache  # never a weight lease: the seed opens no NCCL session with it
    assert grant.cache_key == KEY  # and it fetches this key only
    assert "control_token" not in repr(found.sources[0])
    with pytest.raises(NotFound):
        c.compile_cache_sources(OTHER, identity_key=IKEY)
    c.delete_instance(near.id)
    found = c.compile_cache_sources(KEY, identity_key=IKEY)
    assert found is not None
    assert [s.instance_id for s in found.sources] == [far.id]
    c.set_status(far.id, "DRAINING")
    assert c.compile_cache_sources(KEY, identity_key=IKEY) is None


def test_a_register_token_cannot_get_its_own_seed_offered(secure: PlannerServer) -> None:
    """The attack: a register token declares a key and its own control_url, goes READY, and waits."""
    reg = PlannerClient(secure.url, token="reg-secret")
    load = PlannerClient(secure.url, token="load-secret")
    admin = PlannerClient(secure.url, token="adm-secret")
    no_manifest, _ = _serving(reg, node="victim-node", manifests=False)
    with pytest.raises(NotFound, match="no anchored archive digest"):
        load.compile_cache_sources(KEY, identity_key=IKEY)
    honest, _ = _serving(PlannerClient(secure.url, token="anc-secret"), node="n1")  # anchors the weights
    admin.anchor_compile_cache(KEY, DIGEST, key_variant=KV, identity_key=identity_key(IDENT))
    other_identity, _ = _serving(reg, node="victim-node", ident=identity(fingerprint="attacker"))
    forged = manifest(0)
    forged["tensors"][0]["checksum"] = "cd"
    liar = reg.register_instance(
        identity=IDENT, ranks=ranks(0), control_url="http://victim-node:9",
        control_key=control_token.new_control_key(), compile_cache_keys=[KEY],
    )
    with pytest.raises(Conflict, match="differ from the identity's anchored set"):
        reg.with_token(liar.token).put_manifest(liar.id, 0, forged)
    found = load.compile_cache_sources(KEY, identity_key=IKEY, labels={"node": "victim-node"})
    assert found is not None
    assert [s.instance_id for s in found.sources] == [honest.id]
    assert {no_manifest.id, other_identity.id, liar.id}.isdisjoint(s.instance_id for s in found.sources)
    # nor can it set the digest: only an admin or an anchor-role instance serving the key
    with pytest.raises(AuthError) as refused:
        reg.with_token(no_manifest.token).anchor_compile_cache(KEY, FORGED, key_variant=KV)
    assert refused.value.status == 403
    again = load.compile_cache_sources(KEY, identity_key=IKEY)
    assert again is not None
    assert again.archive_digest == DIGEST


def test_who_may_set_a_digest_and_when(secure: PlannerServer) -> None:
    anchor = PlannerClient(secure.url, token="anc-secret")
    admin = PlannerClient(secure.url, token="adm-secret")
    mine, _ = _serving(anchor, node="n1")
    own = anchor.with_token(mine.token)
    for token in ("load-secret", "read-secret", "reg-secret"):
        c = PlannerClient(secure.url, token=token)
        with pytest.raises(AuthError) as refused:
            c.anchor_compile_cache(KEY, DIGEST, key_variant=KV, identity_key=mine.identity_key)
        assert refused.value.status == 403
    with pytest.raises(Conflict, match="does not serve"):
        own.anchor_compile_cache(OTHER, DIGEST, key_variant=VARIANTS[OTHER])
    with pytest.raises(Conflict, match="own identity"):
        own.anchor_compile_cache(KEY, DIGEST, key_variant=KV, identity_key="f" * 64)
    with pytest.raises(AuthError):
        own.anchor_compile_cache(KEY, DIGEST, key_variant=KV, replace=True)  # an admin's only
    first = own.anchor_compile_cache(KEY, DIGEST, key_variant=KV)
    assert (first.identity_key, first.instance_id) == (mine.identity_key, mine.id)
    assert first.archive_digest == DIGEST
    again = own.anchor_compile_cache(KEY, DIGEST, key_variant=KV)
    assert again.created_at == first.created_at  # the same again: a no-op
    other_anchor, _ = _serving(anchor, node="n2")
    with pytest.raises(Conflict, match="another archive digest"):  # the first authority wins
        anchor.with_token(other_anchor.token).anchor_compile_cache(KEY, FORGED, key_variant=KV)
    with pytest.raises(Conflict, match="another archive digest"):
        admin.anchor_compile_cache(KEY, FORGED, key_variant=KV, identity_key=mine.identity_key)
    # its own cache grew after it first settled: it moves
    grown = own.anchor_compile_cache(KEY, GROWN, key_variant=KV)
    assert (grown.archive_digest, grown.instance_id) == (GROWN, mine.id)
    own.anchor_compile_cache(KEY, DIGEST, key_variant=KV)
    with pytest.raises(Conflict, match="identity_key"):
        admin.anchor_compile_cache(OTHER, DIGEST, key_variant=VARIANTS[OTHER])
    replaced = admin.anchor_compile_cache(
        KEY, FORGED, key_variant=KV, identity_key=mine.identity_key, replace=True
    )
    assert (replaced.archive_digest, replaced.instance_id) == (FORGED, "")
    with pytest.raises(BadRequest):
        admin.anchor_compile_cache(KEY, "sha256:xyz", key_variant=KV, identity_key=IKEY)


def test_registration_with_keys_needs_a_control_endpoint_and_valid_keys(server: PlannerServer) -> None:
    c = PlannerClient(server.url)
    with pytest.raises(Conflict, match="control_url"):
        c.register_instance(identity=identity(), ranks=ranks(0), compile_cache_keys=[KEY])
    with pytest.raises(BadRequest, match="compile_cache_keys"):
        c.register_instance(identity=identity(), ranks=ranks(0), compile_cache_keys=["../etc"])
    with pytest.raises(Conflict, match="twice"):
        _serving(c, node="n1", keys=(KEY, KEY))


def test_an_instance_token_sees_only_its_own_identity(planner_url: str) -> None:
    tokens = {**TOKENS, "instance_token": "reg-load-secret"}  # register + load: its instances may lease
    with PlannerServer(db_url=planner_url, port=0, insecure=False, reaper_interval_s=3600, **tokens) as srv:
        reg = PlannerClient(srv.url, token="reg-load-secret")
        anchor_seed, _ = _serving(PlannerClient(srv.url, token="anc-secret"), node="n0")  # anchors weights
        admin = PlannerClient(srv.url, token="adm-secret")
        admin.anchor_compile_cache(KEY, DIGEST, key_variant=KV, identity_key=anchor_seed.identity_key)
        mine, _ = _serving(reg, node="n1")
        other = reg.register_instance(identity=identity(fingerprint="other"), ranks=ranks(0))

        def sources(token: str) -> Any:
            return PlannerClient(srv.url, token=token).compile_cache_sources(KEY, identity_key=IKEY)

        assert sources("load-secret") is not None
        assert sources(other.token) is None
        assert sources(mine.token) is not None
        with pytest.raises(AuthError):
            sources("read-secret")


def test_an_anchor_seed_cannot_anchor_another_identitys_key(secure: PlannerServer) -> None:
    """The attack: a seed with the anchor role, registered under a made-up identity, lists the victim
    identity's key, anchors it with its own archive and waits for the victim's loader. The key is
    derived from its identity, so the planner refuses the anchor; the victim's own anchor seed sets it."""
    anchor = PlannerClient(secure.url, token="anc-secret")
    load = PlannerClient(secure.url, token="load-secret")
    victim, variant = KEY, KV  # the victim identity's key: anyone computes it ahead of time
    made_up, _ = _serving(
        anchor, node="victim-node", ident=identity(fingerprint="made-up"), keys=(victim,)
    )
    with pytest.raises(Conflict, match="not a key of identity"):
        anchor.with_token(made_up.token).anchor_compile_cache(
            victim, FORGED, key_variant=variant
        )
    with pytest.raises(NotFound) as nothing:
        load.compile_cache_sources(victim, identity_key=IKEY)
    assert nothing.value.reason == "not_anchored"
    # the victim identity's own anchor seed anchors its key: the squatter held nothing
    honest, _ = _serving(anchor, node="n1", keys=(victim,))
    anchored = anchor.with_token(honest.token).anchor_compile_cache(
        victim, DIGEST, key_variant=variant
    )
    assert (anchored.identity_key, anchored.archive_digest) == (IKEY, DIGEST)
    found = load.compile_cache_sources(victim, identity_key=IKEY)
    assert found is not None
    assert [s.instance_id for s in found.sources] == [honest.id]
    # a loader names the identity it asks for: another identity's request finds nothing to fetch
    with pytest.raises(NotFound) as foreign:
        load.compile_cache_sources(victim, identity_key=made_up.identity_key)
    assert foreign.value.reason == "not_anchored"
    # an admin's upload is checked the same way
    admin = PlannerClient(secure.url, token="adm-secret")
    with pytest.raises(Conflict, match="not a key of identity"):
        admin.anchor_compile_cache(
            victim, FORGED, key_variant=variant, identity_key=made_up.identity_key,
            replace=True,
        )


def test_sources_are_ranked_by_evidence_and_a_loader_replaces_what_it_tried(secure: PlannerServer) -> None:
    """Decoys copy the anchored manifest and list the key on the loader's node; a seed that served the
    key verified before, and the one whose compile anchored it, come first wherever they are."""
    anchor = PlannerClient(secure.url, token="anc-secret")
    reg = PlannerClient(secure.url, token="reg-secret")
    load = PlannerClient(secure.url, token="load-secret")
    origin, _ = _serving(anchor, node="far")
    anchor.with_token(origin.token).anchor_compile_cache(KEY, DIGEST, key_variant=KV)  # its own compile
    served, _ = _serving(reg, node="far2")
    decoys = [_serving(reg, node="near")[0].id for _ in range(3)]

    def order(**kw: Any) -> list[str]:
        found = load.compile_cache_sources(KEY, identity_key=IKEY, labels={"node": "near"}, **kw)
        return [] if found is None else [s.instance_id for s in found.sources]

    assert order() == [origin.id, *sorted(decoys), served.id]  # then nearest first
    load.report_compile_cache(KEY, served.id, "verified")
    load.report_compile_cache(KEY, decoys[0], "failed", error="archive digest does not match")
    assert order() == [origin.id, served.id, *sorted(decoys[1:]), decoys[0]]
    assert order(exclude=[origin.id, served.id, *decoys[1:]]) == [decoys[0]]
    assert order(exclude=[origin.id, served.id, *decoys]) == []  # none left: compile
    with pytest.raises(NotFound, match="does not serve"):
        load.report_compile_cache(KEY, "f" * 32, "verified")
    with pytest.raises(NotFound):
        load.report_compile_cache(OTHER, served.id, "verified")  # not anchored
    with pytest.raises(AuthError):  # a reader reports nothing
        PlannerClient(secure.url, token="read-secret").report_compile_cache(KEY, served.id, "verified")
    with pytest.raises(BadRequest):
        load.report_compile_cache(KEY, served.id, "great")
