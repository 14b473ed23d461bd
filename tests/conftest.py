"""Fixtures shared by every test package: database URLs (SQLite file, real PostgreSQL)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# The suite runs shm on libfabric 1.17 too (RFORK_LIBFABRIC_LIB=system), whose shm does not enforce
# remote access: allow read-only regions there (peers are this suite's own processes); the refusal
# itself is tested in tests/backends/test_conformance.py with this unset.
os.environ.setdefault("RFORK_ALLOW_UNENFORCED_ACCESS", "1")

PG_ADMIN_DSN = os.environ.get("RFORK_TEST_PG_DSN", "host=127.0.0.1 port=5432 user=postgres dbname=test")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A SQLAlchemy URL for a new, empty SQLite file private to this test."""
    return f"sqlite:///{tmp_path / 'planner.db'}"


def _pg_unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"PostgreSQL is required in CI but unavailable: {reason}")
    pytest.skip(f"PostgreSQL not reachable on 127.0.0.1:5432 ({reason})")


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A SQLAlchemy URL for a fresh PostgreSQL database, created for this test session and dropped after.

    In CI (CI=true) an unreachable server fails the test instead of skipping it.
    """
    try:
        import psycopg
    except ImportError as exc:  # pragma: no cover - psycopg is a dependency
        _pg_unavailable(f"psycopg missing: {exc}")
        raise
    name = f"rfork_test_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.Error as exc:
        _pg_unavailable(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    params = dict(kv.split("=", 1) for kv in PG_ADMIN_DSN.split())
    url = (
        f"postgresql+psycopg://{params.get('user', 'postgres')}@{params.get('host', '127.0.0.1')}:"
        f"{params.get('port', '5432')}/{name}"
    )
    try:
        yield url
    finally:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Both databases the planner supports: a SQLite file and the real PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'planner.db'}"
    return str(request.getfixturevalue("postgres_url"))
