"""RFORK_SEED_NETWORKS holds the fabric addresses a seed's descriptors name, before the provider sees them.

A tcp name is a socket address the provider connects to (and sends bytes to) at the first read, so a
seed could point every loader at any host:port; the reads of both pull paths (registered reads and
bounce slots) are refused before anything is connected.
"""

from __future__ import annotations

import base64
import ipaddress
import socket
import struct
import time
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from backends.descriptor import EngineAddress, MemoryRegionDescriptor
from backends.errors import TransferError
from backends.providers.peer_names import peer_ip, sockaddr_ip
from planner.contract import RankManifest, RegionEntry, TensorEntry
from rfork.errors import PullError
from rfork.pull.one_sided import OneSidedReader
from rfork.pull.read_plan import ReadPlan
from rfork.pull.staged import pull_staged
from rfork.seed_networks import SeedNetworkRefused, check_engine_address
from rfork.weights import checksum as ck
from rfork.weights.rank_weights import RankWeights
from tests.rfork.conftest import opts

ALLOW_10 = {"RFORK_SEED_NETWORKS": "10.0.0.0/8"}


def sockaddr_in(host: str, port: int) -> bytes:
    """A struct sockaddr_in as the tcp provider names its endpoints."""
    return struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton(host) + bytes(8)


def sockaddr_in6(host: str, port: int) -> bytes:
    """A struct sockaddr_in6 (flow info and scope id zero)."""
    return struct.pack("=H", socket.AF_INET6) + struct.pack("!HI", port, 0) + socket.inet_pton(
        socket.AF_INET6, host
    ) + bytes(4)


def engine_address(provider: str, *names: bytes) -> bytes:
    return EngineAddress(provider, names).to_bytes()


@given(st.ip_addresses(), st.integers(0, 65535))
def test_a_socket_address_reads_back_as_its_ip_and_port(ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
                                                        port: int) -> None:
    raw = sockaddr_in(str(ip), port) if ip.version == 4 else sockaddr_in6(str(ip), port)
    assert sockaddr_ip(raw) == (ip, port)


@given(st.binary(max_size=40))
def test_any_bytes_as_a_peer_name_are_an_address_or_a_transfer_error(raw: bytes) -> None:
    try:
        ip, _port = sockaddr_ip(raw)
    except TransferError:
        return
    assert ip.version in (4, 6)


@given(st.ip_addresses(v=4))
def test_a_tcp_address_is_allowed_exactly_when_inside_the_networks(ip: ipaddress.IPv4Address) -> None:
    address = engine_address("tcp", sockaddr_in("10.1.2.3", 7000), sockaddr_in(str(ip), 7001))
    if ip in ipaddress.ip_network("10.0.0.0/8"):
        check_engine_address(address, env=ALLOW_10)
    else:
        with pytest.raises(SeedNetworkRefused, match=str(ip)):
            check_engine_address(address, env=ALLOW_10)


@given(st.binary(max_size=64))
def test_a_garbled_address_is_refused_when_networks_are_set(blob: bytes) -> None:
    try:
        check_engine_address(blob, env=ALLOW_10)
    except SeedNetworkRefused:
        return
    ea = EngineAddress.from_bytes(blob)  # it passed: a well-formed address whose every name is allowed
    for name in ea.domains:
        ip = peer_ip(ea.provider, name)
        assert ip is None or ip in ipaddress.ip_network("10.0.0.0/8")


def test_loopback_behind_an_ipv4_mapped_ipv6_address_is_refused() -> None:
    address = engine_address("verbs", sockaddr_in6("::ffff:127.0.0.1", 7000))
    with pytest.raises(SeedNetworkRefused, match="outside RFORK_SEED_NETWORKS"):
        check_engine_address(address, env=ALLOW_10)
    check_engine_address(address, env={"RFORK_SEED_NETWORKS": "127.0.0.0/8"})


def test_shm_names_a_process_on_this_host_and_efa_no_ip_address() -> None:
    shm = engine_address("shm", b"fi_shm://4242:0:0\x00")
    with pytest.raises(SeedNetworkRefused, match="127.0.0.1"):
        check_engine_address(shm, env=ALLOW_10)
    check_engine_address(shm, env={"RFORK_SEED_NETWORKS": "127.0.0.1/32"})
    check_engine_address(engine_address("efa", bytes(32)), env=ALLOW_10)


def test_unset_networks_check_nothing() -> None:
    check_engine_address(b"not an address", env={})
    check_engine_address(engine_address("tcp", sockaddr_in("127.0.0.1", 1)), env={"RFORK_SEED_NETWORKS": " "})


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A plain TCP listener on loopback: what a hostile descriptor points the provider at."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        sock.setblocking(False)
        yield sock


def _manifest_naming(listener: socket.socket) -> tuple[RankManifest, RankWeights]:
    """A one-tensor manifest whose region descriptor names `listener`, and a destination for it."""
    data = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
    name = sockaddr_in(*listener.getsockname())
    desc = MemoryRegionDescriptor(engine_address("tcp", name), (1,), 0, data.numel(), "read")
    encoded = base64.b64encode(desc.to_bytes()).decode()
    manifest = RankManifest(
        rank=0,
        checksum_algorithm=ck.algorithm_for("cpu"),
        regions=[RegionEntry(index=0, nbytes=data.numel(), descriptor=encoded)],
        tensors=[
            TensorEntry(
                name="w", dtype="uint8", shape=[data.numel()], nbytes=data.numel(), region=0, offset=0,
                checksum=ck.tensor_checksum(data),
            )
        ],
    )
    manifest.check()
    return manifest, RankWeights.from_tensors(tensors={"w": torch.empty_like(data)})


def _read(reader: OneSidedReader, plan: ReadPlan, *, staged: bool) -> None:
    """Read as the loader would: straight into host memory, or through bounce slots."""
    deadline = time.monotonic() + 2.0
    if staged:
        pull_staged(reader.engine(), plan, deadline=deadline, progress=None, phases={})
    else:
        reader.read(plan, deadline=deadline, progress=None, phases={})


@pytest.mark.parametrize("staged", [False, True])
def test_a_descriptor_outside_the_networks_is_refused_before_anything_connects(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch, staged: bool
) -> None:
    monkeypatch.setenv("RFORK_SEED_NETWORKS", "10.0.0.0/8")
    manifest, dest = _manifest_naming(listener)
    reader = OneSidedReader(opts(staged_reads=staged))
    try:
        plan = ReadPlan.check(manifest, dest)
        with pytest.raises(PullError, match="outside RFORK_SEED_NETWORKS"):
            _read(reader, plan, staged=staged)
    finally:
        reader.close()
    with pytest.raises(BlockingIOError):  # nothing connected: no connection waits to be accepted
        listener.accept()
