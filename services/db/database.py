"""The one-call entry point: a URL in, a ready `Database` (engine + session factory) out.

`open_database(url, migrate=True)` upgrades the schema first (single-node / dev mode); the default
`migrate=False` only verifies the schema is at head, which is what a production gateway replica should do
after `carpool migrate` ran once.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine

from services.db.engine import (
    DEFAULT_POOL_SIZE,
    SessionFactory,
    make_engine,
    make_session_factory,
    normalize_database_url,
)
from services.db.schema import check_at_head, upgrade_to_head


@dataclass(frozen=True)
class Database:
    """An engine and its session factory; `with db.sessions.begin() as s:` runs one transaction."""

    url: str
    engine: Engine
    sessions: SessionFactory

    def dispose(self) -> None:
        """Close pooled connections (at shutdown, or in tests before dropping the database)."""
        self.engine.dispose()


def open_database(url: str, *, migrate: bool = False, echo: bool = False,
                  pool_size: int = DEFAULT_POOL_SIZE) -> Database:
    """Connect to `url`; upgrade it to head when `migrate`, else raise `SchemaVersionError` unless at head.
    `pool_size`: connections the process keeps open (services/db/engine.py)."""
    url = normalize_database_url(url)
    engine = make_engine(url, echo=echo, pool_size=pool_size)
    try:
        # Pass the engine (not the URL) so that a SQLite :memory: database is migrated in place.
        if migrate:
            upgrade_to_head(engine)
        else:
            check_at_head(engine)
    except BaseException:
        engine.dispose()
        raise
    return Database(url=url, engine=engine, sessions=make_session_factory(engine))
