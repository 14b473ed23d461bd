"""Database access: engines (SQLite tuned for concurrent writers), sessions and Alembic migrations.

Write transactions are serialised per seed: on PostgreSQL with row locks (SELECT ... FOR UPDATE),
on SQLite by starting every write transaction with BEGIN IMMEDIATE (one writer at a time; WAL lets
readers go on). Read-only sessions use a plain BEGIN.

Migrations run one at a time per database, so that any number of `rfork planner migrate` and
`rfork planner serve` processes may start at once: on PostgreSQL under a session-level advisory lock
(MIGRATION_LOCK_ID) held around Alembic's upgrade on the same connection (released by the server if
the process dies); on a SQLite file under an flock of its `-writelock` side file (which this host's
planner writers take too). Either wait is bounded (MIGRATION_LOCK_TIMEOUT_S). Database errors come
out as one line naming the database (DatabaseError), never a SQL dump.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not on Windows: SQLite's busy timeout alone then
    fcntl = None  # type: ignore[assignment]

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Connection, Engine, create_engine, event, pool, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

READONLY = "rfork_readonly"
CONNECT_TIMEOUT_S = 10  # PostgreSQL: a host that drops packets is an error after this, not a hang
MIGRATION_LOCK_ID = 0x72666F726B6D6967  # pg_advisory_lock key of the planner's migrations ("rforkmig")
MIGRATION_LOCK_TIMEOUT_S = 600.0  # how long a migration waits for another one to finish


class DatabaseError(RuntimeError):
    """The planner database cannot be reached, migrated or served as it is; the message is one line
    that names the database (password hidden) and says what to do."""


def is_sqlite(url: str) -> bool:
    """True for any SQLite URL (sqlite://, sqlite+pysqlite://)."""
    return url.startswith("sqlite")


def make_engine(url: str, *, pool_size: int = 16) -> Engine:
    """An engine for `url`; SQLite gets WAL, a busy timeout and BEGIN IMMEDIATE for writes."""
    if not is_sqlite(url):
        return create_engine(
            url,
            pool_size=pool_size,
            max_overflow=pool_size,
            pool_pre_ping=True,
            connect_args=_connect_args(url),
        )
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
def _flocked(fd: int | None, *, timeout_s: float | None = None, what: str = "") -> Iterator[None]:
    """Hold an exclusive flock of `fd`; without `timeout_s` it blocks, else DatabaseError (naming
    `what`) once the wait exceeds it."""
    if fd is None or fcntl is None:
        yield
        return
    if timeout_s is None:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks in the kernel with the GIL released
    else:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise DatabaseError(
                        f"another process has held the {what} for more than {timeout_s:g} s"
                    ) from None
                time.sleep(0.05)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def migrations_dir() -> Path:
    """Alembic's script directory (env.py, versions/): `planner/migrations` in the wheel, the top-level
    `migrations/` beside `planner/` in a checkout. Found by path, never imported by name: a project's
    own `migrations` folder (Django, Flask, Alembic) on sys.path must not stand in for it."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "migrations", here.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise DatabaseError(
        f"the planner's migrations are missing: neither {here}/migrations nor {here.parent}/migrations"
    )


def alembic_config(url: str) -> Config:
    """An Alembic Config built in code (no alembic.ini), so it works from an installed package."""
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["rfork_url"] = url
    return cfg


def migrate(url: str, revision: str = "head", *, lock_timeout_s: float = MIGRATION_LOCK_TIMEOUT_S) -> None:
    """Upgrade the database at `url` to `revision` (default: the newest), one migration at a time per
    database (see the module docstring). DatabaseError (one line) when it cannot."""
    log.info("migrating %s to %s", redact_url(url), revision)
    with _one_line_errors(url, "cannot migrate"), _migration_lock(url, lock_timeout_s) as conn:
        cfg = alembic_config(url)
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def downgrade(url: str, revision: str = "base", *, lock_timeout_s: float = MIGRATION_LOCK_TIMEOUT_S) -> None:
    """Downgrade the database at `url` to `revision` (default: empty), under the same lock as migrate."""
    with _one_line_errors(url, "cannot downgrade"), _migration_lock(url, lock_timeout_s) as conn:
        cfg = alembic_config(url)
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def check_schema(url: str) -> None:
    """For `serve --no-migrate`: DatabaseError unless the database is at this code's newest revision.

    A database at a revision this code does not know (a newer planner migrated it) is served with a
    warning, so that a rollback or a rolling upgrade's older pods keep starting.
    """
    script = ScriptDirectory.from_config(alembic_config(url))
    head = script.get_current_head()
    with _one_line_errors(url, "cannot read the schema of"):
        engine = create_engine(url, poolclass=pool.NullPool, connect_args=_connect_args(url))
        try:
            with engine.connect() as conn:
                current = MigrationContext.configure(conn).get_current_revision()
        finally:
            engine.dispose()
    if current == head:
        return
    if current is None:
        raise DatabaseError(
            f"planner database {redact_url(url)} has no schema; run `rfork planner migrate` first"
        )
    try:
        script.get_revision(current)
    except CommandError:
        log.warning(
            "planner database %s is at revision %s, newer than this planner's %s; serving anyway",
            redact_url(url), current, head,
        )
        return
    raise DatabaseError(
        f"planner database {redact_url(url)} is at revision {current}, this planner needs {head}; "
        "run `rfork planner migrate` first"
    )


@contextmanager
def _migration_lock(url: str, timeout_s: float) -> Iterator[Connection | None]:
    """Hold the database's migration lock; yields the connection Alembic must migrate on (PostgreSQL),
    or None (SQLite and others: Alembic opens its own)."""
    if is_sqlite(url):
        fd = _file_lock_for(url)  # None: in memory, one process
        try:
            with _flocked(fd, timeout_s=timeout_s, what=f"migration lock of {redact_url(url)}"):
                yield None
        finally:
            if fd is not None:
                os.close(fd)
        return
    if make_url(url).get_backend_name() != "postgresql":
        yield None
        return
    engine = create_engine(url, poolclass=pool.NullPool, connect_args=_connect_args(url))
    try:
        with engine.connect() as conn:
            # bounded wait: lock_timeout applies to advisory locks too; reset before Alembic's DDL
            wait_ms = str(int(timeout_s * 1000))
            conn.execute(text("SELECT set_config('lock_timeout', :ms, false)"), {"ms": wait_ms})
            try:
                conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_ID})
            except DBAPIError as exc:
                if getattr(exc.orig, "sqlstate", None) == "55P03":  # lock_not_available
                    raise DatabaseError(
                        f"another migration has held the migration lock of {redact_url(url)} for more than "
                        f"{timeout_s:g} s"
                    ) from None
                raise
            conn.execute(text("RESET lock_timeout"))
            conn.commit()  # Alembic then begins and commits its own transaction on this connection
            try:
                yield conn
            finally:
                if conn.in_transaction():
                    conn.rollback()
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_ID})
                conn.commit()
    finally:
        engine.dispose()


@contextmanager
def _one_line_errors(url: str, doing: str) -> Iterator[None]:
    """Turn a driver's multi-line error (SQL, parameters, a link) into DatabaseError's one line."""
    try:
        yield
    except DBAPIError as exc:
        first = (str(exc.orig).strip() or type(exc.orig).__name__).splitlines()[0]
        unreachable = isinstance(exc, OperationalError)
        hint = " (check --db or $RFORK_DB_URL, and that the database is up)" if unreachable else ""
        raise DatabaseError(f"{doing} the planner database {redact_url(url)}: {first}{hint}") from None


def _connect_args(url: str) -> dict[str, Any]:
    """PostgreSQL gets a connect timeout unless the URL sets one."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql" and "connect_timeout" not in parsed.query:
        return {"connect_timeout": CONNECT_TIMEOUT_S}
    return {}


def redact_url(url: str) -> str:
    """The database URL with everything between its user name and its last `@` hidden: read as text, not
    parsed, so a malformed URL (which a parser may split anywhere) never shows its password either."""
    head, at, host = url.rpartition("@")
    if not at:
        return url
    scheme_end = head.find("://")  # only a `://` before the last `@` ends a scheme
    prefix, creds = (head[: scheme_end + 3], head[scheme_end + 3 :]) if scheme_end >= 0 else ("", head)
    return f"{prefix}{creds.split(':', 1)[0]}:***@{host}"
