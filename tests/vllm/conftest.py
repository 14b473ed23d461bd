"""Fixtures for the real-vLLM tests: a tiny Llama on disk, vLLM servers on CPU (servers.py).

These tests need vLLM, which lives in its own venv (`scripts/dev.sh test-vllm`); elsewhere the whole
directory is skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM runs in .venv-vllm: scripts/dev.sh test-vllm")

from tests.integrations.server_flow import flow, planner  # noqa: E402, F401 - test_servers.py's fixtures
from tests.vllm.servers import ServerFleet, write_vllm_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vllm_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server_fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[ServerFleet]:
    fleet = ServerFleet(tmp_path_factory.mktemp("vllm-servers"), tiny_model)
    try:
        yield fleet
    finally:
        fleet.close()
