"""Schema versioning through Alembic's API: upgrade a database to head, or check that it is there.

Services never create tables themselves: `carpool migrate` calls `upgrade_to_head`, and the gateway and
worker call `check_at_head` at startup so that running new code on an old schema fails loudly and early.
The Alembic scripts live in the repository's `migrations/` directory, found next to the `services`
package (which is where an editable install, the supported one, leaves it) or via
`$CARPOOL_MIGRATIONS_DIR`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from services.db.engine import make_engine, sqlite_foreign_keys_disabled

MIGRATIONS_DIR_ENV = "CARPOOL_MIGRATIONS_DIR"
MIGRATE_HINT = "run `carpool migrate`"


class SchemaVersionError(RuntimeError):
    """The database's schema revision is not the one this code was written for."""

    def __init__(self, current: str | None, expected: str, message: str) -> None:
        super().__init__(message)
        self.current = current
        self.expected = expected


def migrations_dir() -> Path:
    """The Alembic script directory: `$CARPOOL_MIGRATIONS_DIR`, else `<repo>/migrations`."""
    override = os.environ.get(MIGRATIONS_DIR_ENV, "").strip()
    # services/db/schema.py -> parents[2] is the directory holding the `services` package.
    path = Path(override) if override else Path(__file__).resolve().parents[2] / "migrations"
    if not (path / "env.py").is_file():
        raise FileNotFoundError(
            f"Alembic migrations not found at {path}: install Carpool editable from a checkout "
            f"(pip install -e .) or set {MIGRATIONS_DIR_ENV}"
        )
    return path


def alembic_config() -> Config:
    """An Alembic config built in code (no alembic.ini needed) that points at `migrations_dir()`."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    # The application owns logging; alembic.ini's logging section is only for the alembic CLI.
    config.attributes["configure_logger"] = False
    return config


def head_revision() -> str:
    """The newest revision in the migration scripts (the one this code expects)."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no migrations in {migrations_dir()}")
    return head


@contextmanager
def _engine(target: str | Engine) -> Iterator[Engine]:
    """Use the caller's engine as is, or a short-lived one for a URL (disposed afterwards)."""
    if isinstance(target, Engine):
        yield target
        return
    engine = make_engine(target)
    try:
        yield engine
    finally:
        engine.dispose()


def current_revision(target: str | Engine) -> str | None:
    """The revision the database is at; None for a database Alembic never touched."""
    with _engine(target) as engine, engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def _run(target: str | Engine, action: str, revision: str) -> None:
    with (
        _engine(target) as engine,
        engine.connect() as connection,
        sqlite_foreign_keys_disabled(connection),
    ):
        config = alembic_config()
        config.attributes["connection"] = connection
        getattr(command, action)(config, revision)
        connection.commit()


def upgrade_to_head(target: str | Engine) -> None:
    """Apply every pending migration to the database at `target` (a URL, or an engine such as :memory:)."""
    _run(target, "upgrade", "head")


def downgrade_to_base(target: str | Engine) -> None:
    """Undo every migration (drops all of Carpool's tables). For tests and disaster recovery only."""
    _run(target, "downgrade", "base")


def check_at_head(target: str | Engine) -> None:
    """Raise `SchemaVersionError` unless the database is at exactly the revision this code expects."""
    expected = head_revision()
    current = current_revision(target)
    if current == expected:
        return
    if current is not None and not _is_known(current):
        message = (
            f"database schema is at {current}, which this code does not know (it expects {expected}): "
            "the database was migrated by a newer Carpool; run that version"
        )
    else:
        shown = current if current is not None else "no revision (empty database)"
        message = f"database schema is at {shown}, code expects {expected}: {MIGRATE_HINT}"
    raise SchemaVersionError(current, expected, message)


def _is_known(revision: str) -> bool:
    scripts = ScriptDirectory.from_config(alembic_config())
    return any(script.revision == revision for script in scripts.walk_revisions())
