"""Database access: engines (SQLite tuned for concurrent writers), sessions and Alembic migrations.

Write transactions are serialised per seed: on PostgreSQL with row locks (SELECT ... FOR UPDATE),
on SQLite by starting every write transaction with BEGIN IMMEDIATE (one writer at a time; WAL lets
readers go on). Read-only sessions use a plain BEGIN.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not on Windows: SQLite's busy timeout alone then
    fcntl = None  # type: ignore[assignment]

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

READONLY = "rfork_readonly"


def is_sqlite(url: str) -> bool:
    """True for any SQLite URL (sqlite://, sqlite+pysqlite://)."""
    return url.startswith("sqlite")


def make_engine(url: str, *, pool_size: int = 16) -> Engine:
    """An engine for `url`; SQLite gets WAL, a busy timeout and BEGIN IMMEDIATE for writes."""
    if not is_sqlite(url):
        return create_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": 30.0},
        pool_size=pool_size,
        max_overflow=pool_size,
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA busy_timeout = 30000")
        if ":memory:" not in url and url not in ("sqlite://", "sqlite:///"):
            cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get(READONLY) else "BEGIN IMMEDIATE")

    return engine


class Database:
    """An engine plus two session factories: `write()` (serialised as above) and `read()`."""

    def __init__(self, url: str, *, pool_size: int = 16) -> None:
        self.url = url
        self.engine = make_engine(url, pool_size=pool_size)
        self.sqlite = is_sqlite(url)
        self._write = sessionmaker(self.engine, expire_on_commit=False)
        self._write_lock = threading.Lock() if self.sqlite else None
        self._file_lock = _file_lock_for(url) if self.sqlite else None
        self._read = sessionmaker(self.engine.execution_options(**{READONLY: True}), expire_on_commit=False)
        # committed write transactions of this process that changed rows (SQLite: the connection's
        # total_changes moved; PostgreSQL: every write transaction counts). Read it before a query
        # whose answer is cached: an unchanged count means no write of this process came in between.
        self.changes = 0
        self._tick = itertools.count()

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A session whose transaction commits on exit (rolls back on error)."""
        with self._serialised():
            with self._write() as session, session.begin():
                before = self._rows_changed(session.connection())
                yield session
                changed = self._rows_changed(session.connection()) != before
            self.changes += changed

    @contextmanager
    def write_core(self) -> Iterator[Connection]:
        """A Core connection in a write transaction (commits on exit, rolls back on error): the hot
        paths' statements need no ORM session, whose set-up is a good part of a short transaction."""
        with self._serialised():
            with self.engine.begin() as conn:
                before = conn.info["rfork_changes_at_begin"] = self._rows_changed(conn)
                yield conn
                changed = self._rows_changed(conn) != before
            self.changes += changed

    def unchanged(self, conn: Connection) -> bool:
        """Whether `conn`'s write transaction (write_core) has changed no rows so far (PostgreSQL:
        never known, so False)."""
        return self.sqlite and self._rows_changed(conn) == conn.info.get("rfork_changes_at_begin")

    def _rows_changed(self, conn: Connection) -> int:
        """SQLite: rows this connection has changed since it opened; PostgreSQL: a new number each time
        (no cheap equivalent, so every write transaction counts as a change)."""
        if not self.sqlite:
            return next(self._tick)  # never equal twice
        dbapi = conn.connection.dbapi_connection
        return int(dbapi.total_changes) if dbapi is not None else -1

    @contextmanager
    def _serialised(self) -> Iterator[None]:
        if self._write_lock is None:
            yield
            return
        # SQLite: one writer per process at a time, so threads queue on a fair lock instead of
        # SQLite's busy handler (which sleeps in coarse steps); other processes still meet BEGIN IMMEDIATE.
        # Across processes (serve --workers N) they queue on an flock of a side file: the kernel wakes
        # the next writer at once, where SQLite's busy handler polls with sleeps of up to 100 ms.
        with self._write_lock, _flocked(self._file_lock):
            yield

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A read-only session (never commits)."""
        with self._read() as session:
            yield session

    def close(self) -> None:
        """Dispose of the engine's connections."""
        self.engine.dispose()
        if self._file_lock is not None:
            os.close(self._file_lock)
            self._file_lock = None


def _file_lock_for(url: str) -> int | None:
    """An open fd on `<database file>-writelock` (None for in-memory databases or without flock)."""
    if fcntl is None:
        return None
    path = make_url(url).database
    if not path or path == ":memory:" or path.startswith("file:"):
        return None
    try:
        return os.open(path + "-writelock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None


@contextmanager
def _flocked(fd: int | None) -> Iterator[None]:
    if fd is None or fcntl is None:
        yield
        return
    fcntl.flock(fd, fcntl.LOCK_EX)  # blocks in the kernel with the GIL released
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def migrations_dir() -> Path:
    """Where the `migrations` package (env.py, versions/) lives, installed or in a checkout."""
    return Path(str(resources.files("migrations")))


def alembic_config(url: str) -> Config:
    """An Alembic Config built in code (no alembic.ini), so it works from an installed package."""
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["rfork_url"] = url
    return cfg


def migrate(url: str, revision: str = "head") -> None:
    """Upgrade the database at `url` to `revision` (default: the newest)."""
    log.info("migrating %s to %s", _redact(url), revision)
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    """Downgrade the database at `url` to `revision` (default: empty)."""
    command.downgrade(alembic_config(url), revision)


def _redact(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)
