"""Carpool's control-plane database: models, engines, schema versioning and tenant-scoped repositories.

Entry point: `open_database(url, migrate=...)` returns a `Database` (engine + session factory). The
repositories are plain functions in `tenants`, `sessions`, `runs`, `checkpoints`, `hub_pushes`,
`request_log` and `usage`; each takes a SQLAlchemy `Session` first and, for tenant-owned data, the caller's
`tenant_id` second, returning None for rows of other tenants. They flush but never commit: the caller
owns the transaction (`with db.sessions.begin() as s: ...`).
"""

from services.db.database import Database, open_database
from services.db.engine import (
    DATABASE_URL_ENV,
    database_url_for_data_dir,
    make_engine,
    make_session_factory,
    resolve_database_url,
)
from services.db.errors import ConflictError, NotFoundError
from services.db.schema import SchemaVersionError, check_at_head, upgrade_to_head

__all__ = [
    "DATABASE_URL_ENV",
    "ConflictError",
    "Database",
    "NotFoundError",
    "SchemaVersionError",
    "check_at_head",
    "database_url_for_data_dir",
    "make_engine",
    "make_session_factory",
    "open_database",
    "resolve_database_url",
    "upgrade_to_head",
]
