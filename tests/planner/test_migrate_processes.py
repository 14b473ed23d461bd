"""Concurrent `rfork planner migrate` and `rfork planner serve` starts on one fresh database end with one
schema and no error: the migration runs under a lock (PostgreSQL: an advisory lock; SQLite: an flock).

The processes are real `rfork` command lines. Each imports everything first and then waits for a start
file, so that the upgrades start within milliseconds of each other instead of an import's jitter apart.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text

from planner.models import Base
from tests.conftest import PG_ADMIN_DSN, _pg_unavailable
from tests.planner.test_concurrency import free_port
from tests.waiting import wait_until

MIGRATORS = 4
SERVERS = 2

# imports first (the CLI, Alembic, the app), says so (the ready file), then waits for the start file, then
# runs `rfork ARGV`
_STARTER = """
import os, sys, time
import alembic.command, psycopg, sqlalchemy, uvicorn, planner.app, planner.db
from rfork.cli import main
start, ready = sys.argv[1:3]
open(ready, "w").close()
while not os.path.exists(start):
    time.sleep(0.001)
sys.exit(main(sys.argv[3:]))
"""


@pytest.fixture
def fresh_postgres() -> Iterator[str]:
    """A new, empty PostgreSQL database for this test alone (the session's one is already migrated)."""
    import psycopg

    name = f"rfork_migrate_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.Error as exc:
        _pg_unavailable(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    params = dict(kv.split("=", 1) for kv in PG_ADMIN_DSN.split())
    try:
        yield (
            f"postgresql+psycopg://{params.get('user', 'postgres')}@{params.get('host', '127.0.0.1')}:"
            f"{params.get('port', '5432')}/{name}"
        )
    finally:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _start_all(url: str, start: Path, logs: Path) -> tuple[list[subprocess.Popen], list[subprocess.Popen]]:
    env = {**os.environ, "RFORK_REAPER_INTERVAL_S": "3600"}
    argvs = [["planner", "migrate", "--db", url] for _ in range(MIGRATORS)]
    serve = ["planner", "serve", "--db", url, "--insecure", "--port"]
    argvs += [[*serve, str(free_port())] for _ in range(SERVERS)]
    procs = []
    for i, argv in enumerate(argvs):
        with (logs / f"{i}.out").open("wb") as out, (logs / f"{i}.err").open("wb") as err:
            command = [sys.executable, "-c", _STARTER, str(start), str(logs / f"{i}.ready"), *argv]
            procs.append(subprocess.Popen(command, stdout=out, stderr=err, env=env))
    return procs[:MIGRATORS], procs[MIGRATORS:]


def _run_concurrently(url: str, tmp_path: Path) -> None:
    start = tmp_path / "start"
    migrators, servers = _start_all(url, start, tmp_path)
    try:
        procs = (*migrators, *servers)

        def all_ready() -> bool:
            for i, proc in enumerate(procs):
                err = (tmp_path / f"{i}.err").read_text
                assert proc.poll() is None, f"process {i} exited: {err()[-3000:]}"
            return all((tmp_path / f"{i}.ready").exists() for i in range(len(procs)))

        wait_until(all_ready, 120, "every process has imported what it needs and polls the start file")
        start.touch()
        for i, proc in enumerate(migrators):
            rc = proc.wait(timeout=120)
            assert rc == 0, f"migrate {i} exited {rc}: {(tmp_path / f'{i}.err').read_text()[-3000:]}"
        for j, proc in enumerate(servers, start=MIGRATORS):
            out = tmp_path / f"{j}.out"

            def listening(proc: subprocess.Popen = proc, j: int = j, out: Path = out) -> bool:
                assert proc.poll() is None, f"serve exited: {(tmp_path / f'{j}.err').read_text()[-3000:]}"
                return "planner listening" in out.read_text()

            wait_until(listening, 120, "serve gets past its migration")
    finally:
        for proc in (*migrators, *servers):
            if proc.poll() is None:
                proc.terminate()
        for proc in (*migrators, *servers):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    for i in range(MIGRATORS + SERVERS):
        err = (tmp_path / f"{i}.err").read_text()
        assert "Traceback" not in err, f"process {i}: {err[-3000:]}"
        assert "Error" not in err, f"process {i}: {err[-3000:]}"


def _head() -> str:
    from alembic.script import ScriptDirectory

    from planner.db import alembic_config

    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert head
    return head


def _assert_one_schema(url: str) -> None:
    eng = create_engine(url)
    try:
        with eng.connect() as conn:
            versions = [row[0] for row in conn.execute(text("SELECT version_num FROM alembic_version"))]
        assert versions == [_head()]
        assert set(inspect(eng).get_table_names()) >= set(Base.metadata.tables)
    finally:
        eng.dispose()


@pytest.mark.slow
@pytest.mark.postgres
def test_concurrent_migrations_on_postgres(fresh_postgres: str, tmp_path: Path) -> None:
    _run_concurrently(fresh_postgres, tmp_path)
    _assert_one_schema(fresh_postgres)


@pytest.mark.slow
def test_concurrent_migrations_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'planner.db'}"
    _run_concurrently(url, tmp_path)
    _assert_one_schema(url)
