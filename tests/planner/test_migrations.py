"""Migrations: upgrade from empty gives exactly the models' schema; downgrade removes it."""

from __future__ import annotations

import subprocess
import sys

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from planner.db import downgrade, migrate
from planner.models import Base


def _diff(url: str) -> list:
    eng = create_engine(url)
    try:
        with eng.connect() as conn:
            ctx = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True}
            )
            return list(compare_metadata(ctx, Base.metadata))
    finally:
        eng.dispose()


def _tables(url: str) -> set[str]:
    eng = create_engine(url)
    try:
        return set(inspect(eng).get_table_names())
    finally:
        eng.dispose()


def test_upgrade_matches_models_and_downgrade_works(db_url):
    downgrade(db_url) if "alembic_version" in _tables(db_url) else None
    assert _tables(db_url) - {"alembic_version"} == set()
    migrate(db_url)
    assert _tables(db_url) >= set(Base.metadata.tables)
    assert _diff(db_url) == []
    downgrade(db_url)
    assert _tables(db_url) - {"alembic_version"} == set()
    migrate(db_url)
    assert _diff(db_url) == []


def test_cli_migrate(sqlite_url):
    proc = subprocess.run(
        [sys.executable, "-m", "rfork", "planner", "migrate", "--db", sqlite_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert _diff(sqlite_url) == []
