"""planner.contract.wire: the wire types round-trip through JSON, refuse what docs/contracts.md refuses, keep
their secrets out of repr, and embed stored manifests verbatim."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from planner.contract.manifest import RegionEntry, TensorEntry, dump_json
from planner.contract.wire import (
    MAX_BYTES,
    Anchor,
    Assignment,
    AssignmentRequest,
    Candidate,
    HeartbeatAnswer,
    InstanceStatus,
    Labels,
    RankEndpoint,
    RankManifest,
    RankView,
    Registration,
    RegistrationRequest,
    ReportAnswer,
    SourceIdentity,
    StatusChange,
    StoredManifest,
    TransferReport,
    identity_key,
)
from tests.planner.conftest import identity, manifest

IDENTITY_FIELDS = list(identity())

# ---- strategies: valid values of every wire type ----------------------------------------------

text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)
name = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=12)
provider = st.text("abcz09_+-", min_size=1, max_size=8)
b64 = st.binary(max_size=24).map(lambda b: base64.b64encode(b).decode())
hex32 = st.binary(min_size=16, max_size=16).map(bytes.hex)
size = st.integers(1, 65_536)
nbytes = st.integers(0, MAX_BYTES)
finite = st.floats(allow_nan=False, allow_infinity=False)
statuses = st.sampled_from(list(InstanceStatus))

identities = st.builds(
    SourceIdentity,
    model=name,
    revision=name,
    fingerprint=name,
    dtype=name,
    quantization=name,
    tp=size,
    pp=size,
    ep=size,
    dp=size,
    framework=name,
    framework_version=name,
    device_kind=name,
)
labels = st.builds(Labels, node=text, rack=text, zone=text)
endpoints = st.builds(
    RankEndpoint,
    rank=st.integers(0, 1_000_000),
    provider=provider,
    address=b64,
    backends=st.lists(provider, max_size=4),
)
regions = st.builds(RegionEntry, index=st.integers(0, 1_000_000), nbytes=nbytes, descriptor=b64)
tensors = st.builds(
    TensorEntry,
    name=name,
    dtype=name,
    shape=st.lists(nbytes, max_size=4),
    nbytes=nbytes,
    region=st.integers(0, 1_000_000),
    offset=nbytes,
    checksum=text,
)
manifests = st.builds(
    RankManifest,
    rank=st.integers(0, 1_000_000),
    checksum_algorithm=name,
    regions=st.lists(regions, max_size=3),
    tensors=st.lists(tensors, max_size=3),
    origin=st.sampled_from(["disk", "peer"]),
)
anchors = st.builds(Anchor, checksum_algorithm=text, digest_set=text, instance_id=hex32)
candidates = st.builds(
    Candidate,
    instance_id=hex32,
    rank=st.integers(0, 1_000_000),
    provider=provider,
    address=b64,
    backends=st.lists(provider, max_size=3),
    control_url=st.none() | st.just("http://seed:9000"),
    labels=labels,
    anchor=anchors,
    control_token=st.none() | text,
    manifest=manifests,
)
assignments = st.builds(
    Assignment,
    id=hex32,
    expires_at=st.datetimes().map(lambda d: d.isoformat()),
    expires_at_unix=finite,
    candidates=st.lists(candidates, max_size=3),
)
registrations = st.builds(
    Registration,
    id=hex32,
    identity_key=hex32,
    identity=identities.map(lambda i: i.model_dump()),
    labels=labels,
    control_url=st.none() | st.just("https://[::1]:1/"),
    ranks=st.lists(
        st.builds(
            RankView, rank=st.integers(0, 8), provider=provider, address=b64, backends=st.lists(provider)
        )
    ),
    max_concurrent_pulls=st.integers(1, 10_000),
    status=statuses,
    created_at=finite,
    updated_at=finite,
    last_heartbeat=finite,
    quarantined_until=st.none() | finite,
    token=text,
)
registration_requests = st.builds(
    RegistrationRequest,
    identity=identities,
    labels=labels,
    control_url=st.none() | st.sampled_from(["http://seed:1", "https://10.0.0.1:65535/", "http://[fe80::1]"]),
    control_key=st.none() | hex32,
    ranks=st.lists(endpoints, max_size=3),
    max_concurrent_pulls=st.integers(1, 10_000),
)
assignment_requests = st.builds(
    AssignmentRequest,
    identity=identities,
    rank=st.integers(0, 1_000_000),
    labels=labels,
    providers=st.lists(provider, max_size=3),
    backends=st.lists(provider, max_size=3),
    requester_id=st.none() | name,
    exclude=st.lists(text, max_size=3),
    fallback_s=st.none() | st.floats(1e-6, 1e7),
    serves_after=st.integers(0, 10_000),
    waited_s=st.floats(0, 1e7),
)
reports = st.builds(
    TransferReport,
    outcome=st.sampled_from(["success", "failure"]),
    bytes=nbytes,
    seconds=st.floats(0, 1e9),
    backend=st.text("abc", max_size=8),
    reason=st.none() | text,
    error=st.none() | text,
)
WIRE_VALUES = st.one_of(
    identities,
    labels,
    endpoints,
    manifests,
    anchors,
    candidates,
    assignments,
    registrations,
    registration_requests,
    assignment_requests,
    reports,
    st.builds(StatusChange, status=st.sampled_from(["INITIALIZING", "LOADING", "READY", "DRAINING"])),
    st.builds(HeartbeatAnswer, status=statuses, ttl_s=finite),
    st.builds(ReportAnswer, id=hex32, outcome=text, seed_quarantined=st.booleans()),
)


# ---- round trips ------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(WIRE_VALUES)
def test_every_wire_type_round_trips_through_json(value: BaseModel):
    cls = type(value)
    assert cls.model_validate_json(value.model_dump_json()) == value
    assert cls.model_validate_json(dump_json(value)) == value  # the server's encoder says the same
    assert json.loads(dump_json(value)) == json.loads(value.model_dump_json())


@settings(max_examples=100, deadline=None)
@given(candidates, st.sampled_from([" ", "", "\n  "]))
def test_a_stored_manifest_is_embedded_verbatim(cand: Candidate, space: str):
    parsed = cand.rank_manifest()
    # what the planner stores: the publisher's text, spacing and unknown fields included
    text = json.dumps({**parsed.model_dump(), "note": "kept"}, indent=1).replace("\n", "\n" + space)
    stored = cand.model_copy(update={"manifest": StoredManifest(text)})
    raw = dump_json(stored)
    assert text.encode() in raw
    again = Candidate.model_validate_json(raw)
    assert again == cand  # the client sees the same candidate (unknown manifest fields ignored)
    assert json.loads(raw)["manifest"]["note"] == "kept"
    assert stored.rank_manifest() == parsed
    assert json.loads(stored.model_dump_json()) == json.loads(raw)  # pydantic's own encoder agrees
    assert "note" not in repr(stored)  # manifests stay out of repr (up to 32 MiB)


# ---- the identity -----------------------------------------------------------------------------


def test_identity_python_defaults_but_json_requires_every_field():
    ident = SourceIdentity(model="m", revision="r", fingerprint="f", dtype="bfloat16")
    assert ident.model_dump() == {
        "model": "m",
        "revision": "r",
        "fingerprint": "f",
        "dtype": "bfloat16",
        "quantization": "none",
        "tp": 1,
        "pp": 1,
        "ep": 1,
        "dp": 1,
        "framework": "rfork",
        "framework_version": "0",
        "device_kind": "cpu",
    }
    for field in IDENTITY_FIELDS:
        partial = {k: v for k, v in identity().items() if k != field}
        with pytest.raises(ValidationError, match=field):
            SourceIdentity.model_validate(partial)
        with pytest.raises(ValidationError, match=field):
            SourceIdentity.model_validate_json(json.dumps(partial))
        with pytest.raises(ValidationError, match=f"identity.{field}"):
            AssignmentRequest.model_validate_json(json.dumps({"identity": partial, "rank": 0}))
    with pytest.raises(ValidationError, match="colour"):
        SourceIdentity.model_validate({**identity(), "colour": "red"})
    with pytest.raises(ValidationError, match="tp"):
        SourceIdentity(model="m", revision="r", fingerprint="f", dtype="d", tp=0)
    with pytest.raises(ValidationError, match="tp"):
        SourceIdentity.model_validate({**identity(), "tp": True})  # a boolean is not a JSON integer
    assert SourceIdentity.model_validate({**identity(), "tp": 2.0}).tp == 2


def test_identity_key_world_size_and_hash():
    ident = SourceIdentity.model_validate(identity(tp=4, pp=2))
    canon = json.dumps(identity(tp=4, pp=2), sort_keys=True, separators=(",", ":"))
    assert ident.key() == hashlib.sha256(canon.encode()).hexdigest() == identity_key(identity(tp=4, pp=2))
    assert ident.world_size == 8
    same = SourceIdentity.model_validate(dict(reversed(list(identity(tp=4, pp=2).items()))))
    assert same == ident
    assert hash(same) == hash(ident)
    assert ident.key() != SourceIdentity.model_validate(identity(tp=4, pp=1)).key()
    with pytest.raises(ValidationError, match="frozen"):
        ident.tp = 1


# ---- checks JSON Schema cannot state ----------------------------------------------------------


def test_manifest_conflicts():
    assert RankManifest.model_validate(manifest(0)).conflicts() is None
    twice = manifest(0)
    twice["regions"] = twice["regions"] * 2
    assert RankManifest.model_validate(twice).conflicts() == "regions: index values must be unique"
    missing = manifest(0)
    missing["tensors"][1]["region"] = 3
    assert RankManifest.model_validate(missing).conflicts() == "tensors[1].region: no region 3"
    over = manifest(0)
    over["tensors"][0]["offset"] = 1
    assert (
        RankManifest.model_validate(over).conflicts() == "tensors[0]: offset+nbytes exceeds region 0's nbytes"
    )
    assert RankManifest.model_validate(manifest(0)).region_bytes == 64


def test_registration_conflicts():
    def body(*nums: int) -> RegistrationRequest:
        ranks = [{"rank": r, "provider": "tcp", "address": ""} for r in nums]
        return RegistrationRequest.model_validate({"identity": identity(tp=2), "ranks": ranks})

    assert body(0, 1).conflicts() is None
    assert body(0, 2).conflicts() == "ranks: rank 2 is outside tp*pp = 2"
    assert body(1, 1).conflicts() == "ranks: rank 1 is listed twice"


def test_base64_fields_and_their_bytes():
    assert RankEndpoint(rank=0, provider="tcp", address="YWRkcjA=").address_bytes() == b"addr0"
    with pytest.raises(ValidationError, match="address"):
        RankEndpoint(rank=0, provider="tcp", address="***")
    region = RegionEntry(index=3, nbytes=1, descriptor="not base64!")  # stored as the seed sent it
    with pytest.raises(ValueError, match=r"regions\[index=3\]\.descriptor must be base64"):
        region.descriptor_bytes()
    assert (
        RegionEntry(index=0, nbytes=1, descriptor=base64.b64encode(b"\x00k").decode()).descriptor_bytes()
        == b"\x00k"
    )


# ---- secrets stay out of repr -----------------------------------------------------------------


def test_secrets_are_not_in_repr():
    reg = Registration(
        id="a" * 32,
        identity_key="k",
        identity=identity(),
        labels=Labels(),
        control_url=None,
        ranks=[],
        max_concurrent_pulls=2,
        status=InstanceStatus.INITIALIZING,
        created_at=0,
        updated_at=0,
        last_heartbeat=0,
        quarantined_until=None,
        token="rfi_secret-token",
    )
    assert "secret-token" not in repr(reg)
    assert "secret-token" not in str(reg)
    assert reg.model_dump()["token"] == "rfi_secret-token"  # on the wire it is there
    req = RegistrationRequest.model_validate({"identity": identity(), "control_key": "ab" * 16})
    assert "abab" not in repr(req)
    cand = Candidate.model_validate_json(
        orjson.dumps(
            {
                "instance_id": "b" * 32,
                "rank": 0,
                "provider": "tcp",
                "address": "",
                "backends": ["tcp"],
                "control_url": None,
                "labels": {},
                "anchor": {"checksum_algorithm": "a", "digest_set": "d", "instance_id": "c" * 32},
                "control_token": "ctl-secret",
                "manifest": manifest(0),
            }
        )
    )
    assert "ctl-secret" not in repr(cand)
    assert cand.rank_manifest() == RankManifest.model_validate(manifest(0))


def _stored_candidate(text: str) -> dict[str, Any]:
    return {
        "instance_id": "b" * 32,
        "rank": 0,
        "provider": "tcp",
        "address": "",
        "backends": ["tcp"],
        "control_url": None,
        "labels": Labels(),
        "anchor": Anchor(checksum_algorithm="a", digest_set="d", instance_id="c" * 32),
        "manifest": StoredManifest(text),
    }


def test_only_the_server_puts_stored_text_in_a_candidate():
    """From JSON a manifest is always parsed (and checked); a StoredManifest comes only from Python."""
    text = json.dumps(manifest(0))
    cand = Candidate(**_stored_candidate(text))
    assert isinstance(cand.manifest, StoredManifest)
    assert repr(cand.manifest) == f"StoredManifest({len(text)} characters)"
    with pytest.raises(ValidationError, match="manifest"):
        Candidate.model_validate_json(json.dumps({**cand.model_dump(mode="json"), "manifest": text}))
