"""The vLLM hook installs a compile cache into a cache root of its own key, never vLLM's shared root.

Needs vLLM (.venv-vllm, `scripts/dev.sh test-vllm`); no server: vLLM's own `envs` decide where it will
compile, so the test reads them after `cache_entry`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rfork.integrations.vllm import compile_cache

pytestmark = pytest.mark.vllm


def test_the_worker_compiles_and_installs_under_a_root_of_its_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import envs

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "shared"))
    monkeypatch.setattr(compile_cache, "_BASE_ROOT", None)
    entry = compile_cache.cache_entry("ab" * 32)
    assert entry is not None
    own_root = tmp_path / "shared" / "rfork" / ("ab" * 12)
    assert entry == own_root / "torch_compile_cache"
    assert Path(envs.VLLM_CACHE_ROOT) == own_root  # where vLLM now writes its graphs and AOT artifacts
    # another key in the same process: its own root, never one inside the first
    other = compile_cache.cache_entry("cd" * 32)
    assert other == tmp_path / "shared" / "rfork" / ("cd" * 12) / "torch_compile_cache"
    assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / "shared" / "rfork" / ("cd" * 12))
