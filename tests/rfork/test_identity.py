"""rfork.identity: the weights fingerprint and the source identity."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rfork.identity import SourceIdentity, default_labels, fingerprint, global_rank

names = st.text(alphabet="abcdefghij._0123456789", min_size=1, max_size=20)
dtypes = st.sampled_from(["bfloat16", "float16", "float32", "int8", "int64"])
shapes = st.lists(st.integers(min_value=0, max_value=9), min_size=0, max_size=3)


def test_fingerprint_ignores_order_and_sees_shape_and_dtype():
    a = [("x", "bfloat16", (2, 3)), ("y", "float32", (4,))]
    assert fingerprint(a) == fingerprint(list(reversed(a)))
    assert fingerprint(a) != fingerprint([("x", "bfloat16", (3, 2)), ("y", "float32", (4,))])
    assert fingerprint(a) != fingerprint([("x", "float16", (2, 3)), ("y", "float32", (4,))])


def test_identity_round_trip_and_validation():
    ident = SourceIdentity(model="m", revision="r", fingerprint="f", dtype="bfloat16", tp=2, pp=2)
    assert SourceIdentity.model_validate(json.loads(json.dumps(ident.model_dump()))) == ident
    assert ident.world_size == 4
    assert len(ident.key()) == 64
    with pytest.raises(ValidationError, match="tp"):  # on the wire every field is required
        SourceIdentity.model_validate({k: v for k, v in ident.model_dump().items() if k != "tp"})
    with pytest.raises(ValidationError, match="tp"):
        SourceIdentity(model="m", revision="r", fingerprint="f", dtype="bf16", tp=0)
    assert global_rank(tp_rank=1, pp_rank=1, tp_size=2) == 3  # not tp_rank alone
    with pytest.raises(ValueError, match="tp_rank=2"):
        global_rank(tp_rank=2, pp_rank=0, tp_size=2)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(names, st.tuples(dtypes, shapes), min_size=1, max_size=12), st.randoms())
def test_fingerprint_is_a_function_of_the_set(specs, rnd):
    items = [(n, d, s) for n, (d, s) in specs.items()]
    shuffled = list(items)
    rnd.shuffle(shuffled)
    assert fingerprint(items) == fingerprint(shuffled)


def test_default_labels_from_env_else_hostname(monkeypatch):
    import socket

    for var in ("RFORK_NODE", "RFORK_RACK", "RFORK_ZONE"):
        monkeypatch.delenv(var, raising=False)
    assert default_labels() == {"node": socket.gethostname(), "rack": "rack0", "zone": "zone0"}
    monkeypatch.setenv("RFORK_NODE", "node-a")
    monkeypatch.setenv("RFORK_RACK", "r7")
    monkeypatch.setenv("RFORK_ZONE", "z2")
    assert default_labels() == {"node": "node-a", "rack": "r7", "zone": "z2"}
    monkeypatch.setenv("RFORK_RACK", "")  # empty counts as unset
    assert default_labels()["rack"] == "rack0"
