"""The compile-cache key: every field changes the digest; the processor tag reads the CPU flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from planner.contract import compile_cache_key
from rfork.compile_cache.key import CompileCacheKey, processor_tag, settings_digest

KEY = CompileCacheKey(
    identity_key="a" * 64,
    rank=0,
    engine="vllm",
    engine_version="0.32.0",
    torch_version="2.13.0+cpu",
    settings_digest=settings_digest({"max_num_batched_tokens": 2048}),
    processor="x86_64:0123456789abcdef",
)


def test_digest_is_stable_hex_and_every_field_counts() -> None:
    assert KEY.digest() == dataclasses.replace(KEY).digest()
    assert len(KEY.digest()) == 64
    changed: dict[str, Any] = {
        "identity_key": "b" * 64,
        "rank": 1,
        "engine": "sglang",
        "engine_version": "0.33.0",
        "torch_version": "2.14.1",
        "settings_digest": settings_digest({"max_num_batched_tokens": 4096}),
        "processor": "aarch64:0123456789abcdef",
    }
    digests = {dataclasses.replace(KEY, **{k: v}).digest() for k, v in changed.items()}
    assert len(digests) == len(changed)
    assert KEY.digest() not in digests


def test_the_key_is_bound_to_its_identity() -> None:
    """The planner derives the key from the identity and the variant: another identity's variant
    never yields this key."""
    assert KEY.digest() == compile_cache_key(KEY.identity_key, KEY.variant())
    other = dataclasses.replace(KEY, identity_key="b" * 64)
    assert other.variant() == KEY.variant()  # the variant says nothing about the identity
    assert compile_cache_key(other.identity_key, KEY.variant()) != KEY.digest()


def test_settings_digest_ignores_key_order() -> None:
    assert settings_digest({"a": 1, "b": [2]}) == settings_digest({"b": [2], "a": 1})


def test_empty_fields_and_negative_rank_are_refused() -> None:
    with pytest.raises(ValueError, match="engine_version"):
        dataclasses.replace(KEY, engine_version="")
    with pytest.raises(ValueError, match="rank"):
        dataclasses.replace(KEY, rank=-1)


def test_processor_tag_follows_the_cpu_flags(tmp_path: Path) -> None:
    avx512, avx2 = tmp_path / "a", tmp_path / "b"
    avx512.write_text("processor\t: 0\nflags\t\t: sse avx2 avx512f\n")
    avx2.write_text("processor\t: 0\nflags\t\t: avx2 sse\n")
    assert processor_tag(cpuinfo=avx512) != processor_tag(cpuinfo=avx2)
    assert processor_tag(cpuinfo=avx2) == processor_tag(cpuinfo=avx2)
    assert processor_tag(cpuinfo=avx2, gpu="cuda:sm90").endswith(":cuda:sm90")
    assert processor_tag(cpuinfo=tmp_path / "missing")  # no /proc: still a tag
