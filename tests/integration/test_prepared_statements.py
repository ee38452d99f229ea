"""`PreparedStatement` against SQLAlchemy itself, on SQLite and a scratch PostgreSQL database.

What it must keep from `Connection.execute`: values stored and read exactly as SQLAlchemy stores and reads
them (timezone-aware datetimes through `UtcDateTime`), scalar column defaults, driver errors raised as
SQLAlchemy's (`IntegrityError`), statement listeners called, row counts; and it refuses what it cannot
prepare (expanding IN, missing parameters, callable defaults) with an error that says what to do.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, bindparam, event, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from services.db import Database
from services.db.columns import UtcDateTime
from services.db.prepared import PreparedStatement

T0 = datetime(2026, 3, 4, 5, 6, 7, 891011, tzinfo=UTC)

_META = MetaData()
_ITEMS = Table(
    "prepared_probe", _META,
    Column("id", String(32), primary_key=True),
    Column("at", UtcDateTime, nullable=True),
    Column("weight", Integer, nullable=False, default=7),
)
_CALLABLE_DEFAULT = Table(  # compiled only: the refusal comes before any driver call
    "prepared_probe_callable", MetaData(),
    Column("id", String(32), primary_key=True),
    Column("note", String(32), nullable=True, default=lambda: "computed"),
)
_INSERT = PreparedStatement(insert(_ITEMS), column_keys=("id", "at"))
_SELECT = PreparedStatement(select(_ITEMS.c.id, _ITEMS.c.at, _ITEMS.c.weight)
                            .where(_ITEMS.c.id == bindparam("id")))
_BUMP = PreparedStatement(update(_ITEMS).where(_ITEMS.c.weight < bindparam("below"))
                          .values(weight=_ITEMS.c.weight + bindparam("by")))


@pytest.fixture
def db(database: Database) -> Iterator[Session]:
    _META.create_all(database.engine)
    try:
        with database.sessions.begin() as session:
            yield session
            session.rollback()
    finally:
        _META.drop_all(database.engine)


def test_round_trip_matches_sqlalchemy(db: Session) -> None:
    _INSERT.execute(db, {"id": "a", "at": T0})
    _INSERT.execute(db, {"id": "b", "at": T0.astimezone(UTC) + timedelta(hours=1)})
    via_sqlalchemy = db.execute(select(_ITEMS.c.id, _ITEMS.c.at, _ITEMS.c.weight)
                                .where(_ITEMS.c.id == "a")).one()
    assert _SELECT.execute(db, {"id": "a"}) == [tuple(via_sqlalchemy)]
    assert via_sqlalchemy.at == T0 and via_sqlalchemy.at.tzinfo is not None
    assert via_sqlalchemy.weight == 7  # the scalar column default, filled in by the prepared INSERT
    assert _SELECT.execute(db, {"id": "missing"}) == []


def test_counts_and_executemany(db: Session) -> None:
    _INSERT.executemany(db, [{"id": f"r{i}", "at": None} for i in range(4)])
    _INSERT.executemany(db, [])  # nothing to do, no driver call
    assert _BUMP.execute_count(db, {"below": 8, "by": 3}) == 4
    assert _BUMP.execute_count(db, {"below": 8, "by": 3}) == 0
    assert db.execute(select(_ITEMS.c.weight).distinct()).scalars().all() == [10]


def test_driver_errors_are_sqlalchemy_errors(db: Session) -> None:
    _INSERT.execute(db, {"id": "dup", "at": T0})
    savepoint = db.begin_nested()
    with pytest.raises(IntegrityError):
        _INSERT.execute(db, {"id": "dup", "at": T0})
    savepoint.rollback()
    assert _SELECT.execute(db, {"id": "dup"})[0][0] == "dup"  # the transaction goes on after the savepoint


def test_statement_listeners_see_prepared_statements(database: Database, db: Session) -> None:
    seen: list[tuple[str, Any, bool]] = []

    def note(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        seen.append((statement, parameters, executemany))

    event.listen(database.engine, "before_cursor_execute", note)
    try:
        _INSERT.execute(db, {"id": "x", "at": T0})
        _INSERT.executemany(db, [{"id": "y", "at": None}, {"id": "z", "at": None}])
    finally:
        event.remove(database.engine, "before_cursor_execute", note)
    assert [s.split()[0:3] for s, _, _ in seen] == [["INSERT", "INTO", "prepared_probe"]] * 2
    assert [many for _, _, many in seen] == [False, True]


def test_refuses_what_it_cannot_prepare(db: Session) -> None:
    expanding = PreparedStatement(select(_ITEMS.c.id).where(_ITEMS.c.id.in_(["a", "b"])))
    with pytest.raises(ValueError, match="expanding IN"):
        expanding.execute(db, {})
    with pytest.raises(ValueError, match="needs parameter 'at'"):
        _INSERT.execute(db, {"id": "no-at"})
    with_callable_default = PreparedStatement(insert(_CALLABLE_DEFAULT), column_keys=("id",))
    with pytest.raises(ValueError, match="'note' has a default that is not a scalar"):
        with_callable_default.execute(db, {"id": "c"})
