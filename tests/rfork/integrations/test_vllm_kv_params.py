"""The kv_transfer_params a client hands the decode server (via the proxy): anything else than what an
rfork prefill server returned is refused with KvParamsError naming the field, never another error."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rfork.integrations.vllm.kv_params import MAX_RID, KvParamsError, RemotePrefill

GOOD = RemotePrefill(b"RFEA\x01engine-address", "cmpl-1", (4, 5, 9), 32)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def test_params_round_trip() -> None:
    assert RemotePrefill.from_params(GOOD.to_params()) == GOOD


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["rfork_address", "remote_request_id", "remote_block_ids", "remote_block_size"]),
       json_values)
def test_any_bad_field_is_refused_by_name(field: str, value: Any) -> None:
    params = GOOD.to_params()
    params[field] = value
    try:
        got = RemotePrefill.from_params(params)
    except KvParamsError as exc:
        message = str(exc)
    else:  # the value happened to be valid: it is what was parsed
        assert got.to_params()[field] == value
        return
    assert field in message


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("rfork_address", "", "1..4096 bytes"),
    ("remote_request_id", "x" * (MAX_RID + 1), "remote_request_id"),
    ("remote_block_ids", [1, -1], "block ids >= 0"),
    ("remote_block_ids", [True], "block ids >= 0"),
    ("remote_block_size", 0, "positive"),
])
def test_out_of_range_fields_are_refused(field: str, value: Any, needle: str) -> None:
    params = GOOD.to_params()
    params[field] = value
    with pytest.raises(KvParamsError, match=needle):
        RemotePrefill.from_params(params)


def test_params_from_another_connector_are_named_as_such() -> None:
    with pytest.raises(KvParamsError, match="did not come from an rfork prefill server"):
        RemotePrefill.from_params({"do_remote_prefill": True, "remote_engine_id": "nixl-1"})
