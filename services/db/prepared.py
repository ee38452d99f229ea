"""Prepared statements: hot-path Core statements compiled once per backend and run on the driver's cursor.

Why: every tenant step writes the request log four or five times (a submission's facts, INSERT and seq-id
UPDATE on the group-commit writer; the `running` marker; the completion's `done` marks and usage on the
scheduler loop). Through SQLAlchemy's `Connection.execute` each statement costs 50–100 µs of Python
(execution context, parameter processing, result wrapping) for a statement SQLite runs in a few µs; eight
small tenants pay it eight times per pass where one tenant pays it once (docs/performance.md, session 24).

A `PreparedStatement` compiles its statement once per dialect, keeps the bind and result processors of its
columns' types (so datetimes are stored exactly as SQLAlchemy stores them), and executes on the DBAPI
connection under the session's `Connection`: the same transaction, the same connection, one driver call.
What SQLAlchemy would otherwise do around the call is kept where something depends on it:
- `before_cursor_execute` / `after_cursor_execute` listeners are called (tests count statements; tracing);
- driver errors are raised as SQLAlchemy's (`IntegrityError` for the unique-key race callers retry), and a
  lost connection is invalidated so the pool does not hand it out again.

Not supported (refused when the statement is compiled): expanding `IN` parameters (spell the values out)
and column defaults that are not scalars (pass the value).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Executable
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.sql.compiler import SQLCompiler

from services.db.statements import core

Processor = Callable[[Any], Any]


@dataclass(frozen=True)
class _Compiled:
    """One statement's SQL for one dialect and how to turn keyword parameters into the driver's."""

    sql: str
    names: tuple[str, ...]
    """Bind names in the driver's order (positional paramstyles) or the keys it reads (named ones)."""
    positional: bool
    defaults: Mapping[str, Any]
    """Values of binds the caller does not pass (literals, scalar column defaults)."""
    binds: Mapping[str, Processor]
    """Bind processors of the names that have one."""
    results: tuple[Processor | None, ...]

    def parameters(self, values: Mapping[str, Any]) -> tuple[Any, ...] | dict[str, Any]:
        merged = {**self.defaults, **values} if self.defaults else values
        converted = []
        for name in self.names:
            if name not in merged:
                raise ValueError(f"prepared statement needs parameter {name!r}")
            process = self.binds.get(name)
            converted.append(merged[name] if process is None else process(merged[name]))
        if self.positional:
            return tuple(converted)
        return dict(zip(self.names, converted, strict=True))


class PreparedStatement:
    """A Core statement run on the driver; build it once at import time, like the statements it replaces.

    `column_keys`: for an INSERT, the columns its parameters carry (the VALUES clause follows them)."""

    def __init__(self, statement: Executable, *, column_keys: Sequence[str] | None = None) -> None:
        self._statement = statement
        self._column_keys = list(column_keys) if column_keys is not None else None
        self._by_dialect: dict[str, _Compiled] = {}

    def execute(self, db: Session | Connection, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """Run it once; returns the rows it produced (SELECT, RETURNING), processed like SQLAlchemy's."""
        rows, _ = self._run(db, [params], many=False)
        return rows

    def execute_count(self, db: Session | Connection, params: Mapping[str, Any]) -> int:
        """Run it once; returns the rows it touched (a conditional UPDATE reports success so)."""
        return self._run(db, [params], many=False)[1]

    def executemany(self, db: Session | Connection, rows: Sequence[Mapping[str, Any]]) -> None:
        """Run it once per parameter set, in one driver call."""
        if rows:
            self._run(db, rows, many=True)

    def _run(self, db: Session | Connection, rows: Sequence[Mapping[str, Any]],
             many: bool) -> tuple[list[tuple[Any, ...]], int]:
        connection = core(db) if isinstance(db, Session) else db
        compiled = self._compiled(connection.dialect)
        params: Any = [compiled.parameters(r) for r in rows] if many else compiled.parameters(rows[0])
        dbapi_connection = connection.connection.dbapi_connection
        assert dbapi_connection is not None, "the session's connection is closed"
        cursor = dbapi_connection.cursor()
        try:
            sql, params = _before(connection, cursor, compiled.sql, params, many)
            try:
                (cursor.executemany if many else cursor.execute)(sql, params)
                fetched = cursor.fetchall() if cursor.description is not None else []
            except connection.dialect.loaded_dbapi.Error as exc:
                raise driver_error(connection, cursor, exc, sql, params, many) from exc
            _after(connection, cursor, sql, params, many)
            return [_processed(row, compiled.results) for row in fetched], cursor.rowcount
        finally:
            cursor.close()

    def _compiled(self, dialect: Dialect) -> _Compiled:
        found = self._by_dialect.get(dialect.name)
        if found is None:
            found = self._by_dialect[dialect.name] = _compile(self._statement, dialect, self._column_keys)
        return found


def _compile(statement: Executable, dialect: Dialect, column_keys: list[str] | None) -> _Compiled:
    compiled = statement.compile(dialect=dialect, column_keys=column_keys)  # type: ignore[attr-defined]
    assert isinstance(compiled, SQLCompiler)
    expanding = [name for name, bind in compiled.binds.items() if bind.expanding and name in compiled.params]
    if expanding:
        raise ValueError(f"expanding IN parameters {expanding} cannot be prepared: spell the values out")
    # An INSERT's value binds carry a REQUIRED marker, not a value: the caller passes those.
    defaults = {name: value for name, value in compiled.params.items()
                if value is not None and not compiled.binds[name].required}
    for column in compiled.insert_prefetch + compiled.update_prefetch:
        default = column.default if column in compiled.insert_prefetch else column.onupdate
        if default is None or not default.is_scalar:
            raise ValueError(f"column {column.name!r} has a default that is not a scalar: pass its value")
        defaults[column.key] = default.arg
    names = tuple(compiled.positiontup) if compiled.positional else tuple(compiled.params)
    binds = {}
    for name in set(names):
        process = compiled.binds[name].type.dialect_impl(dialect).bind_processor(dialect)
        if process is not None:
            binds[name] = process
    results = tuple(column.type.dialect_impl(dialect).result_processor(dialect, None)
                    for column in getattr(statement, "exported_columns", ()))
    return _Compiled(str(compiled), names, compiled.positional, defaults, binds, results)


def _processed(row: Sequence[Any], processors: tuple[Processor | None, ...]) -> tuple[Any, ...]:
    if not any(processors):
        return tuple(row)
    return tuple(value if process is None else process(value)
                 for value, process in zip(row, processors, strict=False))


def _before(connection: Connection, cursor: Any, sql: str, params: Any, many: bool) -> tuple[str, Any]:
    for listener in connection.dispatch.before_cursor_execute:
        sql, params = listener(connection, cursor, sql, params, None, many)
    return sql, params


def _after(connection: Connection, cursor: Any, sql: str, params: Any, many: bool) -> None:
    for listener in connection.dispatch.after_cursor_execute:
        listener(connection, cursor, sql, params, None, many)


def driver_error(connection: Connection, cursor: Any, exc: Exception, sql: str, params: Any,
                 many: bool) -> DBAPIError:
    """The driver's error as SQLAlchemy raises it; a lost connection is invalidated first."""
    dialect = connection.dialect
    lost = dialect.is_disconnect(exc, connection.connection.dbapi_connection, cursor)
    if lost:
        connection.invalidate(exc)
    return DBAPIError.instance(sql, params, exc, dialect.loaded_dbapi.Error, connection_invalidated=lost,
                               dialect=dialect, ismulti=many)
