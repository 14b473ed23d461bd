"""The kv_transfer_params a client hands the decode server (via the proxy): anything else than what an
rfork prefill server returned is refused with KvParamsError naming the field, never another error; the
prefill engine they name is joined only inside prefill_networks and RFORK_SEED_NETWORKS."""

from __future__ import annotations

import ipaddress
import socket
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.descriptor import EngineAddress
from backends.kv import KvError
from rfork.integrations.vllm.kv_params import MAX_RID, KvParamsError, RemotePrefill
from rfork.integrations.vllm.kv_worker import check_prefill_address

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


def _tcp(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int = 4242) -> bytes:
    """A tcp engine address naming one endpoint at ip (a sockaddr, as libfabric's tcp provider names it)."""
    if ip.version == 4:
        name = struct.pack("<H", socket.AF_INET) + struct.pack(">H", port) + ip.packed + bytes(8)
    else:
        name = struct.pack("<H", socket.AF_INET6) + struct.pack(">HI", port, 0) + ip.packed + bytes(4)
    return EngineAddress("tcp", (name,)).to_bytes()


ALLOWED = [ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("fd00::/8")]


@settings(max_examples=100, deadline=None)
@given(st.ip_addresses())
def test_a_prefill_engine_is_joined_only_inside_prefill_networks(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> None:
    inside = any(ip in n for n in ALLOWED)
    if inside:
        check_prefill_address(_tcp(ip), ALLOWED)
    else:
        with pytest.raises(KvError, match=f"{ip} is outside prefill_networks"):
            check_prefill_address(_tcp(ip), ALLOWED)
    check_prefill_address(_tcp(ip), None)  # no list: any address
    check_prefill_address(_tcp(ip), [ipaddress.ip_network("0.0.0.0/0")])  # a /0: any engine


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=64), st.sampled_from(["tcp", "shm", "efa", "verbs"]))
def test_any_prefill_address_is_refused_with_kv_error_or_placed(blob: bytes, provider: str) -> None:
    for address in (blob, EngineAddress(provider, (blob,)).to_bytes()):
        try:
            check_prefill_address(address, ALLOWED)
        except KvError:
            continue
        hosts = EngineAddress.from_bytes(address).hosts()
        assert hosts
        assert all(any(h in n for n in ALLOWED) for h in hosts)


def test_rfork_seed_networks_applies_to_the_prefill_engine_too(monkeypatch: pytest.MonkeyPatch) -> None:
    loopback = ipaddress.ip_address("127.0.0.1")
    check_prefill_address(_tcp(loopback), None)
    efa = EngineAddress("efa", (bytes(32),)).to_bytes()
    check_prefill_address(efa, [ipaddress.ip_network("::/0")])
    with pytest.raises(KvError, match="on efa names no IP address; prefill_networks cannot allow it"):
        check_prefill_address(efa, ALLOWED)
    monkeypatch.setenv("RFORK_SEED_NETWORKS", "10.0.0.0/8")
    with pytest.raises(KvError, match="127.0.0.1 is outside RFORK_SEED_NETWORKS"):
        check_prefill_address(_tcp(loopback), None)
    with pytest.raises(KvError, match="names no IP address; RFORK_SEED_NETWORKS"):
        check_prefill_address(efa, None)
    shm = EngineAddress("shm", (b"fi_shm://1:0:0\x00",)).to_bytes()
    with pytest.raises(KvError, match="127.0.0.1 is outside RFORK_SEED_NETWORKS"):
        check_prefill_address(shm, None)
    check_prefill_address(_tcp(ipaddress.ip_address("10.1.2.3")), None)
