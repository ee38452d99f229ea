"""Engines and sessions for the control-plane database: URL resolution, SQLite pragmas, session factories.

PostgreSQL (via psycopg 3) is the production backend; SQLite (a file under the data dir) is the
zero-dependency single-node default. Nothing here creates tables: see `services.db.schema` for that.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, Dialect, make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from services.db.prepared import driver_error

DATABASE_URL_ENV = "CARPOOL_DATABASE_URL"
SQLITE_FILENAME = "carpool.db"
# Writers wait this long for the SQLite write lock instead of failing at once with "database is locked".
SQLITE_BUSY_TIMEOUT_MS = 30_000

SessionFactory = sessionmaker[Session]

DEFAULT_POOL_SIZE = 24
"""Connections a process keeps open. SQLAlchemy's default (5 kept, 10 more opened and closed again) is
below what one gateway process runs at once (16 blocking-pool threads, the decode pool, every scheduler
loop's completion hook, the sweeper), so under load every transaction beyond the fifth paid a new
connection: on SQLite its PRAGMAs, on PostgreSQL a TCP connect, authentication and a backend process."""
DEFAULT_MAX_OVERFLOW = 8
"""Connections opened past the pool for a burst and closed when returned (the process's cap is the sum)."""


def database_url_for_data_dir(data_dir: Path) -> str:
    """The SQLite URL of the database file under `data_dir` (absolute, so the cwd does not matter)."""
    return f"sqlite:///{(Path(data_dir) / SQLITE_FILENAME).resolve()}"


def database_url_from_env() -> str | None:
    """`$CARPOOL_DATABASE_URL` if set and non-empty, normalised; None otherwise."""
    url = os.environ.get(DATABASE_URL_ENV, "").strip()
    return normalize_database_url(url) if url else None


def resolve_database_url(data_dir: Path | None = None) -> str:
    """The URL to use: the environment wins, else SQLite under `data_dir`."""
    url = database_url_from_env()
    if url is not None:
        return url
    if data_dir is None:
        raise ValueError(f"no database configured: set {DATABASE_URL_ENV} or pass a data dir")
    return database_url_for_data_dir(data_dir)


def normalize_database_url(url: str) -> str:
    """Point bare `postgres://` / `postgresql://` URLs at psycopg 3, the only PostgreSQL driver we ship."""
    parsed = make_url(url)
    if parsed.drivername in ("postgres", "postgresql"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def is_sqlite(url: str | URL) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def _is_sqlite_memory(url: URL) -> bool:
    return url.database in (None, "", ":memory:")


def make_engine(url: str, *, echo: bool = False, pool_size: int = DEFAULT_POOL_SIZE,
                max_overflow: int = DEFAULT_MAX_OVERFLOW) -> Engine:
    """An engine for `url`; on SQLite it enables WAL, foreign keys and a busy timeout on every connection.
    `pool_size` connections stay open once used, `max_overflow` more are opened for a burst.

    SQLite keeps pysqlite's default transaction handling (a transaction opens at the first write, so reads
    never hold a lock that a later write would have to upgrade). The repositories are written for that:
    each state change is one conditional UPDATE or INSERT (a read before it only produces a friendlier
    error; unique constraints remain the backstop). Savepoints are the group commit's
    (`services.db.group_commit`), sent on the driver's cursor (`_savepoints_on_the_cursor`).
    """
    parsed = make_url(normalize_database_url(url))
    pooled = {"pool_size": pool_size, "max_overflow": max_overflow}
    if parsed.get_backend_name() != "sqlite":
        # pre_ping: a pooled connection may have been closed by a PostgreSQL restart or an idle timeout.
        return create_engine(parsed, echo=echo, pool_pre_ping=True, **pooled)
    kwargs: dict[str, Any] = {
        # The gateway hands sessions across threads (thread pool executors); SQLAlchemy's pool already
        # guarantees a connection is used by one thread at a time.
        "connect_args": {"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
    }
    if _is_sqlite_memory(parsed):
        # Every new connection to :memory: is a new empty database; share one connection instead
        # (fine for tests and one-off tools, not for concurrent use).
        kwargs["poolclass"] = StaticPool
    else:
        Path(str(parsed.database)).parent.mkdir(parents=True, exist_ok=True)
        kwargs.update(pooled)
    engine = create_engine(parsed, echo=echo, **kwargs)
    event.listen(engine, "connect", _sqlite_on_connect)
    _savepoints_on_the_cursor(engine.dialect)
    return engine


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        # SQLite ships with foreign keys off; the schema relies on them (cascades, SET NULL).
        cursor.execute("PRAGMA foreign_keys=ON")
        # WAL lets readers proceed while one writer commits; a no-op answer ("memory") for :memory:.
        cursor.execute("PRAGMA journal_mode=WAL")
        # NORMAL is durable across application crashes in WAL mode and much faster than FULL.
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    finally:
        cursor.close()


def _savepoints_on_the_cursor(dialect: Dialect) -> None:
    """SAVEPOINT, RELEASE and ROLLBACK TO of this engine's connections sent as fixed SQL on the driver's cursor.

    SQLAlchemy's dialect runs each through `Connection.execute` of a clause it compiles anew every time
    (savepoint clauses are not cached): about 45 µs per `begin_nested` of the group commit, which opens one
    per submission (session 24's microbenchmark: 0.098 → 0.054 ms per job in groups of three). The names
    are SQLAlchemy's own (`sa_savepoint_N`), so no quoting is needed; a driver error is raised as SQLAlchemy
    would raise it. The connection-level `savepoint` events still fire (they precede these calls)."""
    error = dialect.loaded_dbapi.Error

    def runner(template: str) -> Callable[[Connection, str], None]:
        def run(connection: Connection, name: str) -> None:
            sql = template % name
            cursor = connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
            try:
                cursor.execute(sql)
            except error as exc:  # as the prepared statements raise it (a lost connection invalidated first)
                raise driver_error(connection, cursor, exc, sql, None, False) from exc
            finally:
                cursor.close()

        return run

    # Instance attributes: this engine's dialect only, the class (and other engines) untouched.
    dialect.do_savepoint = runner("SAVEPOINT %s")  # type: ignore[method-assign]
    dialect.do_release_savepoint = runner("RELEASE SAVEPOINT %s")  # type: ignore[method-assign]
    dialect.do_rollback_to_savepoint = runner("ROLLBACK TO SAVEPOINT %s")  # type: ignore[method-assign]


def make_session_factory(engine: Engine) -> SessionFactory:
    """Sessions whose rows stay readable after commit (the gateway serialises them after the transaction).

    Use `with factory.begin() as db:` for a transaction that commits on success and rolls back on error.
    """
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def sqlite_foreign_keys_disabled(connection: Connection) -> Iterator[None]:
    """Turn SQLite foreign keys off for the block (no-op elsewhere); used around schema migrations.

    Batch migrations drop and recreate tables, and with foreign keys on, dropping a parent table would
    cascade-delete its children. The pragma only takes effect outside a transaction, hence the commits.
    """
    if connection.dialect.name != "sqlite":
        yield
        return
    connection.commit()
    connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
    connection.commit()
    try:
        yield
    finally:
        connection.rollback()
        connection.exec_driver_sql("PRAGMA foreign_keys=ON")
        connection.commit()
