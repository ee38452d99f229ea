"""Query building blocks shared by the repositories: dialect-aware INSERTs and pagination.

Only PostgreSQL and SQLite are supported, and both speak `INSERT ... ON CONFLICT`, which lets creates be
idempotent and counters be upserted in one statement, without savepoints (which pysqlite handles poorly).
Statements on the per-request path (request log, seq ids, usage) are built once with bind parameters and
run on the session's connection (`core`), which skips the ORM layer's per-statement cost; the hottest of them
go one step further, to the driver's cursor (`services/db/prepared.py`).
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

from sqlalchemy import Connection, CursorResult, Executable, Select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 100

_T = TypeVar("_T", bound=tuple[Any, ...])


def insert_for(db: Session, table: Any) -> postgresql.Insert | sqlite.Insert:
    """An INSERT for `table` that supports `on_conflict_do_nothing/do_update` on the session's backend."""
    return insert_for_dialect(db.get_bind().dialect.name, table)


def insert_for_dialect(name: str, table: Any) -> postgresql.Insert | sqlite.Insert:
    """`insert_for` by backend name (for statements built once per backend)."""
    if name == "postgresql":
        return postgresql.insert(table)
    if name == "sqlite":
        return sqlite.insert(table)
    raise NotImplementedError(f"unsupported database backend {name!r}: use PostgreSQL or SQLite")


def paginate(stmt: Select[_T], limit: int, offset: int) -> Select[_T]:
    """Apply limit/offset after validating them (an unbounded listing is never what a caller wants)."""
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise ValueError(f"limit must be in [1, {MAX_PAGE_SIZE}], got {limit}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    return stmt.limit(limit).offset(offset)


def core(db: Session) -> Connection:
    """The session's connection, for prebuilt Core statements on hot paths.

    `Session.execute` runs every statement through the ORM layer (~0.1 ms each even when the statement is
    prebuilt, more when it is built per call); the connection runs a cached compiled statement in a few tens
    of microseconds, in the same transaction. Pending ORM changes are flushed first, as `Session.execute`
    would; rows already loaded in the session do not see what these statements change (callers re-read).
    """
    db.flush()
    return db.connection()


def execute_count(db: Session, stmt: Executable) -> int:
    """Run an UPDATE/DELETE and return how many rows it touched (conditional updates report success so)."""
    result = db.execute(stmt)
    return int(cast(CursorResult[Any], result).rowcount)
