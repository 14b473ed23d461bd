"""Migrations: upgrade from empty gives exactly the models' schema; downgrade removes it."""

from __future__ import annotations

import subprocess
import sys

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

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


def test_credentials_upgrade_a_database_in_use(db_url):
    """A database at the revision before credentials were recorded, with an instance and a lease in it,
    upgrades: the old instance stands for itself as a witness and is counted against no credential."""
    downgrade(db_url) if "alembic_version" in _tables(db_url) else None
    migrate(db_url, "0006")
    eng = create_engine(db_url)
    try:
        with eng.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO instances (id, identity_key, identity, model, fingerprint, node, rack, zone,"
                    " status, max_concurrent_pulls, token_hash, created_at, updated_at, last_heartbeat,"
                    " consecutive_failures, may_anchor, may_lease, integrity_failed) VALUES ('old', :k, '{}',"
                    " 'm', 'f', 'n', '', '', 'READY', 2, :h, 1, 1, 1, 0, false, false, false)"
                ),
                {"k": "a" * 64, "h": "b" * 64},
            )
            conn.execute(
                text(
                    "INSERT INTO leases (id, instance_id, rank, identity_key, holder, provider, created_at,"
                    " expires_at) VALUES ('l1', 'old', 0, :k, 'instance:x', 'tcp', 1, 2)"
                ),
                {"k": "a" * 64},
            )
        migrate(db_url)
        assert _diff(db_url) == []
        with eng.connect() as conn:
            assert conn.execute(text("SELECT registered_by FROM instances WHERE id = 'old'")).scalar() is None
            assert conn.execute(text("SELECT credential FROM leases WHERE id = 'l1'")).scalar() is None
    finally:
        eng.dispose()
