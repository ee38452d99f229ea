"""`GroupCommitter` on real SQLite and PostgreSQL: groups form while the writer is busy, each job's error
rolls back its own writes only, a failed commit reaches every job of its group, and callers take turns."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from services.db.engine import is_sqlite, make_engine, make_session_factory
from services.db.group_commit import SQLITE_BEGIN, GroupCommitter
from services.db.testing import scratch_postgres_database
from tests.required import require_postgres

SCHEMA = (
    "CREATE TABLE parent (id INTEGER PRIMARY KEY)",
    "CREATE TABLE item (id INTEGER PRIMARY KEY, caller TEXT NOT NULL, "
    "parent_id INTEGER REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)",
)


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    if request.param == "sqlite":
        yield from _with_schema(f"sqlite:///{tmp_path / 'group.db'}")
        return
    require_postgres()
    with scratch_postgres_database() as url:
        yield from _with_schema(url)


def _with_schema(url: str) -> Iterator[Engine]:
    engine = make_engine(url)
    with engine.begin() as connection:
        for statement in SCHEMA:
            connection.exec_driver_sql(statement)
        connection.exec_driver_sql("INSERT INTO parent (id) VALUES (1)")
    yield engine
    engine.dispose()


def committer(engine: Engine, **kwargs: int) -> GroupCommitter:
    begin = SQLITE_BEGIN if is_sqlite(engine.url) else None
    return GroupCommitter(make_session_factory(engine), begin_sql=begin, **kwargs)


def insert(item_id: int, caller: str = "a", parent_id: int = 1):  # type: ignore[no-untyped-def]
    def fn(db: Session) -> int:
        db.execute(text("INSERT INTO item (id, caller, parent_id) VALUES (:i, :c, :p)"),
                   {"i": item_id, "c": caller, "p": parent_id})
        return item_id
    return fn


def rows(engine: Engine) -> list[int]:
    with engine.connect() as connection:
        return [r[0] for r in connection.exec_driver_sql("SELECT id FROM item ORDER BY id")]


class Gate:
    """A first job that holds the writer until released, so the jobs queued meanwhile form one group."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, db: Session) -> None:
        self.entered.set()
        assert self.release.wait(10)


async def run_behind_gate(writes: GroupCommitter, calls: list[tuple[object, str]]) -> list[object]:
    """Hold the writer, queue `calls` (fn, caller) in order, release it; each call's value or exception."""
    gate = Gate()
    held = asyncio.ensure_future(writes.run(gate, caller="gate"))
    await asyncio.to_thread(gate.entered.wait, 10)
    tasks = [asyncio.ensure_future(writes.run(fn, caller=caller)) for fn, caller in calls]  # type: ignore[arg-type]
    await asyncio.sleep(0.05)  # every job is queued before the writer is let go
    gate.release.set()
    await held
    return list(await asyncio.gather(*tasks, return_exceptions=True))


def test_jobs_queued_while_the_writer_is_busy_commit_as_one_group(engine: Engine) -> None:
    writes = committer(engine)
    try:
        results = asyncio.run(run_behind_gate(writes, [(insert(i), f"t{i}") for i in range(1, 6)]))
    finally:
        writes.close()
    assert results == [1, 2, 3, 4, 5]
    assert rows(engine) == [1, 2, 3, 4, 5]
    assert (writes.stats.groups, writes.stats.jobs, writes.stats.largest) == (2, 6, 5)


def test_a_lone_job_runs_at_once_as_a_group_of_one(engine: Engine) -> None:
    writes = committer(engine)

    async def one_by_one() -> list[int]:
        return [await writes.run(insert(i)) for i in range(1, 4)]

    try:
        assert asyncio.run(one_by_one()) == [1, 2, 3]
    finally:
        writes.close()
    assert (writes.stats.groups, writes.stats.largest) == (3, 1)


def test_a_jobs_error_rolls_back_its_own_writes_only(engine: Engine) -> None:
    """The first job of the group writes and then fails: on SQLite this is what breaks without the explicit
    BEGIN (its SAVEPOINT would be the transaction), so its row must be gone and the others' kept."""

    def writes_then_fails(db: Session) -> None:
        insert(10)(db)
        raise ValueError("refused after writing")

    writes = committer(engine)
    try:
        results = asyncio.run(run_behind_gate(writes, [(writes_then_fails, "a"), (insert(11), "b"),
                                                       (insert(11), "c"), (insert(12), "d")]))
    finally:
        writes.close()
    assert isinstance(results[0], ValueError)
    assert results[1] == 11
    assert isinstance(results[2], IntegrityError)  # the duplicate key: its caller's to retry
    assert results[3] == 12
    assert rows(engine) == [11, 12]
    assert writes.stats.commit_failures == 0


def test_a_lone_jobs_error_rolls_back_its_writes_without_a_savepoint(engine: Engine) -> None:
    """A group of one runs without a savepoint: its error rolls the whole transaction back, reaches its
    caller, and is not counted as a failed commit; the next lone job commits as usual."""
    savepoints: list[str] = []
    event.listen(engine, "savepoint", lambda _conn, name: savepoints.append(name))

    def writes_then_fails(db: Session) -> None:
        insert(20)(db)
        raise ValueError("refused after writing")

    writes = committer(engine)

    async def one_by_one() -> list[object]:
        first = await asyncio.gather(writes.run(writes_then_fails), return_exceptions=True)
        return [*first, await writes.run(insert(21))]

    try:
        results = asyncio.run(one_by_one())
    finally:
        writes.close()
    assert isinstance(results[0], ValueError)
    assert results[1] == 21
    assert rows(engine) == [21]
    assert savepoints == []
    assert (writes.stats.groups, writes.stats.commit_failures) == (2, 0)


def test_savepoints_go_through_the_driver_and_raise_as_sqlalchemy_does(engine: Engine) -> None:
    """`begin_nested` works on the engine's connections (SAVEPOINT, RELEASE and ROLLBACK TO on SQLite are
    sent on the driver's cursor), and a savepoint statement the database refuses raises SQLAlchemy's error."""
    factory = make_session_factory(engine)
    with factory.begin() as db:
        if is_sqlite(engine.url):
            db.connection().exec_driver_sql(SQLITE_BEGIN)
        with db.begin_nested():
            insert(30)(db)
        with pytest.raises(ValueError), db.begin_nested():
            insert(31)(db)
            raise ValueError("rolled back to the savepoint")
    assert rows(engine) == [30]
    if is_sqlite(engine.url):
        with engine.connect() as connection, pytest.raises(OperationalError, match="no such savepoint"):
            connection.dialect.do_release_savepoint(connection, "sa_savepoint_missing")


def test_a_failed_commit_reaches_every_job_that_had_succeeded(engine: Engine) -> None:
    """A deferred foreign key fails at COMMIT: nothing of the group is written and each caller hears it."""
    writes = committer(engine)
    try:
        results = asyncio.run(run_behind_gate(writes, [(insert(20), "a"), (insert(21, parent_id=99), "b"),
                                                       (insert(22), "c")]))
    finally:
        writes.close()
    assert all(isinstance(r, IntegrityError) for r in results), results
    assert rows(engine) == []
    assert writes.stats.commit_failures == 1


def test_callers_take_turns_in_a_group(engine: Engine) -> None:
    """One caller's backlog of six, then two others: with groups of three the others go in the first group."""
    writes = committer(engine, max_group=3)
    order: list[int] = []

    def logged(item_id: int, caller: str):  # type: ignore[no-untyped-def]
        def fn(db: Session) -> int:
            order.append(item_id)
            return insert(item_id, caller)(db)
        return fn

    calls = [(logged(i, "flood"), "flood") for i in range(1, 7)] + [(logged(7, "x"), "x"), (logged(8, "y"), "y")]
    try:
        asyncio.run(run_behind_gate(writes, calls))
    finally:
        writes.close()
    assert order[:3] == [1, 7, 8]
    assert sorted(order) == list(range(1, 9))


def test_a_closed_committer_refuses_new_jobs(engine: Engine) -> None:
    writes = committer(engine)
    writes.close()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(writes.run(insert(1)))
