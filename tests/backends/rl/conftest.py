"""Fixtures the RL tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from backends import TransferEngine


@pytest.fixture
def engines() -> Iterator[list[TransferEngine]]:
    """Two tcp engines on loopback: a trainer's and a receiver's."""
    made = [TransferEngine("tcp", 1, timeout_s=3.0, host="127.0.0.1") for _ in range(2)]
    yield made
    for e in made:
        e.close()
