"""RFORK_SEED_NETWORKS: off by default, a CIDR list when set, fatal when malformed; checked on the
addresses a seed's host resolves to, before any connection (the multi-process check is in
tests/rfork/compile_cache/test_hostile_seed.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rfork.seed_networks import SeedNetworkRefused, allowed_networks, resolve_seed_host


def test_unset_or_empty_allows_every_address() -> None:
    assert allowed_networks({}) is None
    assert allowed_networks({"RFORK_SEED_NETWORKS": " , "}) is None
    assert resolve_seed_host("127.0.0.1", 9, env={}) == [("127.0.0.1", 9)]


def test_a_list_allows_only_its_networks() -> None:
    env = {"RFORK_SEED_NETWORKS": "10.0.0.0/8 ::1/128,127.0.0.0/8"}
    assert [str(n) for n in allowed_networks(env) or []] == ["10.0.0.0/8", "::1/128", "127.0.0.0/8"]
    assert resolve_seed_host("localhost", 9, env=env)  # 127.0.0.1 and/or ::1
    with pytest.raises(SeedNetworkRefused, match="outside RFORK_SEED_NETWORKS"):
        resolve_seed_host("169.254.169.254", 80, env=env)  # e.g. a cloud metadata service
    with pytest.raises(SeedNetworkRefused):
        resolve_seed_host("::ffff:169.254.169.254", 80, env=env)


@pytest.mark.parametrize("bad", ["10.0.0.0/33", "not-a-network", "10.0.0.0/8,*"])
def test_a_malformed_list_is_fatal(bad: str) -> None:
    with pytest.raises(ValueError, match="RFORK_SEED_NETWORKS"):
        allowed_networks({"RFORK_SEED_NETWORKS": bad})


def test_a_malformed_list_stops_a_fetch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from rfork.compile_cache.fetch import fetch_compile_cache
    from rfork.compile_cache.key import CompileCacheKey

    key = CompileCacheKey(
        identity_key="a" * 64, rank=0, engine="vllm", engine_version="1", torch_version="2",
        settings_digest="5" * 64, processor="x86_64:0",
    )
    monkeypatch.setenv("RFORK_SEED_NETWORKS", "10.0.0.0/8,nonsense")
    with pytest.raises(ValueError, match="RFORK_SEED_NETWORKS"):
        fetch_compile_cache(planner_url="http://127.0.0.1:9", token=None, key=key, dest=tmp_path)
