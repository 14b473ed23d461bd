"""The migration lock and the start-up checks around it: a bounded wait, `serve --no-migrate`, one-line
errors for a database that cannot be reached or is not migrated, secrets read from `*_FILE` files."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from planner.db import MIGRATION_LOCK_ID, DatabaseError, _file_lock_for, check_schema, downgrade, migrate
from planner.settings import PlannerSettings, SettingsError


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the with block ends: nothing listens there


def test_a_held_postgres_lock_is_waited_for_then_named(postgres_url: str) -> None:
    holder = create_engine(postgres_url)
    try:
        with holder.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK_ID})
            t0 = time.monotonic()
            with pytest.raises(DatabaseError, match="migration lock") as err:
                migrate(postgres_url, lock_timeout_s=1.0)
            assert 0.9 < time.monotonic() - t0 < 10
            assert "\n" not in str(err.value)
            conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK_ID})
            conn.commit()
        migrate(postgres_url, lock_timeout_s=5.0)  # released: goes through (already at head: a no-op)
    finally:
        holder.dispose()


def test_a_held_sqlite_lock_is_waited_for_then_named(sqlite_url: str) -> None:
    import fcntl

    fd = _file_lock_for(sqlite_url)
    assert fd is not None
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(DatabaseError, match="migration lock"):
            migrate(sqlite_url, lock_timeout_s=0.5)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    migrate(sqlite_url, lock_timeout_s=5.0)
    check_schema(sqlite_url)


def test_check_schema_says_what_to_run(sqlite_url: str) -> None:
    with pytest.raises(DatabaseError, match="no schema; run `rfork planner migrate` first"):
        check_schema(sqlite_url)
    migrate(sqlite_url, "0002")
    with pytest.raises(DatabaseError, match="at revision 0002.*run `rfork planner migrate`"):
        check_schema(sqlite_url)
    migrate(sqlite_url)
    check_schema(sqlite_url)
    downgrade(sqlite_url)
    with pytest.raises(DatabaseError, match="no schema"):
        check_schema(sqlite_url)


def test_a_revision_newer_than_the_code_is_served(sqlite_url: str, caplog: pytest.LogCaptureFixture) -> None:
    migrate(sqlite_url)
    eng = create_engine(sqlite_url)
    with eng.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999_future'"))
    eng.dispose()
    check_schema(sqlite_url)
    assert "newer than this planner" in caplog.text


def test_an_unreachable_postgres_is_one_line_within_the_timeout() -> None:
    url = f"postgresql+psycopg://rfork:hunter2@127.0.0.1:{_closed_port()}/rfork"
    t0 = time.monotonic()
    with pytest.raises(DatabaseError) as err:
        migrate(url)
    assert time.monotonic() - t0 < 15
    message = str(err.value)
    assert "\n" not in message
    assert "hunter2" not in message
    assert message.startswith("cannot migrate the planner database postgresql+psycopg://rfork:***@127.0.0.1")


@pytest.mark.parametrize("command", [["migrate"], ["serve", "--no-migrate"], ["serve"]])
def test_cli_errors_are_one_line(command: list[str], tmp_path: Path) -> None:
    url = f"postgresql+psycopg://rfork:hunter2@127.0.0.1:{_closed_port()}/rfork"
    insecure = ["--insecure"] if command[0] == "serve" else []
    proc = subprocess.run(
        [sys.executable, "-m", "rfork", "planner", *command, "--db", url, *insecure],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("rfork: error:")]
    assert len(errors) == 1, proc.stderr  # one error line (an INFO line may say what was tried)
    assert errors[0].startswith("rfork: error: cannot ")
    assert "Traceback" not in proc.stderr
    assert "hunter2" not in proc.stderr


def test_serve_no_migrate_refuses_an_empty_database(sqlite_url: str) -> None:
    env = {**os.environ, "RFORK_NO_MIGRATE": "true"}
    proc = subprocess.run(
        [sys.executable, "-m", "rfork", "planner", "serve", "--db", sqlite_url, "--insecure", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"rfork: error: planner database {sqlite_url} has no schema; run `rfork planner migrate` first"
    )


def test_secrets_come_from_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    admin = tmp_path / "admin"
    admin.write_text("  s3cret\n")
    url = tmp_path / "db-url"
    url.write_text("sqlite:///from-a-file.db\n")
    monkeypatch.setenv("RFORK_ADMIN_TOKEN_FILE", str(admin))
    monkeypatch.setenv("RFORK_DB_URL_FILE", str(url))
    settings = PlannerSettings()
    assert (settings.admin_token, settings.db_url) == ("s3cret", "sqlite:///from-a-file.db")
    assert PlannerSettings(db_url="sqlite:///given.db").db_url == "sqlite:///given.db"  # --db wins
    monkeypatch.setenv("RFORK_ADMIN_TOKEN", "other")
    with pytest.raises(SettingsError, match=r"both \$RFORK_ADMIN_TOKEN and \$RFORK_ADMIN_TOKEN_FILE"):
        PlannerSettings()
    monkeypatch.delenv("RFORK_ADMIN_TOKEN")
    admin.write_text("\n")
    with pytest.raises(SettingsError, match="is empty"):
        PlannerSettings()
    monkeypatch.setenv("RFORK_ADMIN_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(SettingsError, match="No such file"):
        PlannerSettings()
