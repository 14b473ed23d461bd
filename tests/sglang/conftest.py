"""Fixtures for the real-SGLang tests: a tiny Llama on disk, SGLang servers on CPU (servers.py).

These tests need SGLang, which lives in its own venv (`scripts/dev.sh test-sglang`); elsewhere the
whole directory is skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang runs in .venv-sglang: scripts/dev.sh test-sglang")

from tests.integrations.server_flow import flow, planner  # noqa: E402, F401 - test_servers.py's fixtures
from tests.sglang.servers import ServerFleet  # noqa: E402
from tests.sglang.tiny_model import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server_fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[ServerFleet]:
    fleet = ServerFleet(tmp_path_factory.mktemp("sglang-servers"), tiny_model)
    try:
        yield fleet
    finally:
        fleet.close()
