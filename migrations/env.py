"""Alembic environment: runs Carpool's migrations against the configured database.

Programmatic callers (`services.db.schema`, hence `carpool migrate`) hand over an open connection in
`config.attributes["connection"]` and own its transaction and SQLite pragmas. The `alembic` CLI instead
connects to the `sqlalchemy.url` option if one is set, else to `$CARPOOL_DATABASE_URL`.
"""

from __future__ import annotations

from logging.config import fileConfig
from typing import Any

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy import Connection

from services.db.columns import UtcDateTime
from services.db.engine import (
    DATABASE_URL_ENV,
    database_url_from_env,
    make_engine,
    normalize_database_url,
    sqlite_foreign_keys_disabled,
)
from services.db.models import Base

# Any constant works; it only has to be the same in every process that migrates this database.
_PG_MIGRATION_LOCK_KEY = 0x0CA2_9001

config = context.config
target_metadata = Base.metadata

# Programmatic callers (services.db.schema) configure logging themselves; only the CLI reads alembic.ini's.
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _database_url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return normalize_database_url(url)
    from_env = database_url_from_env()
    if from_env is None:
        raise RuntimeError(f"no database URL: set {DATABASE_URL_ENV}")
    return from_env


def _render_item(kind: str, obj: Any, _autogen: AutogenContext) -> str | bool:
    """Render our column types as plain SQLAlchemy ones: migrations must not import application code."""
    if kind == "type" and isinstance(obj, UtcDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode rewrites the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        render_item=_render_item,
    )


def _migrate(connection: Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Several gateway replicas may start at once; serialise them so only the first one migrates
            # and the others then see the new version (alembic reads it after this point).
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_MIGRATION_LOCK_KEY})")
        context.run_migrations()


def run_migrations_offline() -> None:
    """Emit SQL to stdout (`alembic upgrade head --sql`) without connecting."""
    context.configure(
        url=_database_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    given = config.attributes.get("connection")
    if given is not None:
        _migrate(given)
        return
    engine = make_engine(_database_url())
    try:
        with engine.connect() as connection, sqlite_foreign_keys_disabled(connection):
            _migrate(connection)
            connection.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
