"""Planner test fixtures: a migrated, empty database (SQLite file or the session's PostgreSQL)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from planner import Planner, PlannerServer, PlannerSettings, migrate

TABLES = ("manifests", "instance_ranks", "leases", "instances", "anchors", "compile_cache_anchors")


def identity(**over: Any) -> dict[str, Any]:
    """A valid source identity (tp=2 so ranks 0 and 1 exist)."""
    base = {
        "model": "llama-test",
        "revision": "main",
        "fingerprint": "fp1",
        "dtype": "bfloat16",
        "quantization": "none",
        "tp": 2,
        "pp": 1,
        "ep": 1,
        "dp": 1,
        "framework": "rfork",
        "framework_version": "0.1",
        "device_kind": "cpu",
    }
    base.update(over)
    return base


def manifest(rank: int = 0) -> dict[str, Any]:
    """A small valid manifest (with a zero-byte tensor), published as loaded from disk (so it anchors)."""
    return {
        "rank": rank,
        "origin": "disk",
        "checksum_algorithm": "xxh64",
        "regions": [{"index": 0, "nbytes": 64, "descriptor": base64.b64encode(b"desc").decode()}],
        "tensors": [
            {
                "name": "w",
                "dtype": "float32",
                "shape": [4, 4],
                "nbytes": 64,
                "region": 0,
                "offset": 0,
                "checksum": "ab",
            },
            {
                "name": "empty",
                "dtype": "float32",
                "shape": [0],
                "nbytes": 0,
                "region": 0,
                "offset": 64,
                "checksum": "",
            },
        ],
    }


def ranks(*nums: int, backends: tuple[str, ...] = ("tcp", "nccl")) -> list[dict[str, Any]]:
    """Rank entries for registration."""
    return [
        {"rank": r, "provider": backends[0], "address": f"addr{r}".encode(), "backends": list(backends)}
        for r in nums
    ]


def empty_database(url: str) -> str:
    """`url`, migrated to head and emptied (PostgreSQL is shared by the session, so truncate)."""
    migrate(url)
    if url.startswith("postgresql"):
        eng = create_engine(url)
        with eng.begin() as conn:
            conn.execute(text(f"TRUNCATE {', '.join(TABLES)} CASCADE"))
        eng.dispose()
    return url


@pytest.fixture
def planner_url(db_url: str) -> str:
    """`db_url`, migrated to head and emptied."""
    return empty_database(db_url)


@pytest.fixture
def server(planner_url: str) -> Iterator[PlannerServer]:
    """An insecure planner on the test database."""
    with PlannerServer(db_url=planner_url, port=0, insecure=True, reaper_interval_s=3600) as srv:
        yield srv


def make_planner(url: str, **settings: Any) -> Planner:
    """A service object on `url` (no HTTP), for tests that move time."""
    return Planner.open(PlannerSettings(db_url=url, insecure=True, db_pool_size=4, **settings))


@pytest.fixture
def svc(planner_url: str) -> Iterator[Planner]:
    """A Planner service object with default settings."""
    p = make_planner(planner_url)
    yield p
    p.close()
