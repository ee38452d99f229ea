"""Group commit: short write transactions of many callers run as one database transaction, each in a savepoint.

Why: every tenant step submits two requests, and each submission is a small write transaction (a facts
read, an INSERT into the request log, an UPDATE of the run's seq id). On SQLite one writer holds the lock
at a time, so eight tenants' submissions on eight pool threads pay eight session set-ups, eight commits
(the WAL frames of the same index pages written eight times) and the hand-offs of the GIL and the write
lock between the threads, for work that runs one after the other anyway. One writer thread that takes
whatever has queued up while it was busy pays one commit per group instead.

A caller never waits for company: the writer starts a group as soon as it is idle and a job is queued, so a
lone caller's transaction starts at once (a group of one) and its latency is one thread hop, as before.

Isolation between the callers of a group:
- each job's function runs inside `Session.begin_nested()` (a group of one needs none: its transaction is
  the job's): an exception rolls back that job's writes only (a 429 that must leave nothing logged, a
  unique-key race that the caller retries) and reaches that job's caller alone; the others' writes commit;
- if the commit itself fails, each job that had succeeded gets the commit's error, as it would have from
  its own commit;
- groups are filled round robin over `caller` keys, so one caller's backlog delays another caller by at
  most one job per group, never by the backlog (the gateway's blocking pool keeps the same promise).

SQLite needs the outer transaction open before the first SAVEPOINT: with pysqlite's default handling a
SAVEPOINT outside a transaction would *be* the transaction, and its RELEASE would commit it. The group
therefore starts with `BEGIN IMMEDIATE`, which also takes the write lock up front (the group writes anyway),
so no job of it can fail on a lock upgrade. pysqlite's `commit()` commits a transaction begun that way.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from sqlalchemy.orm import Session

from services.db.engine import SessionFactory

_T = TypeVar("_T")

DEFAULT_MAX_GROUP = 32
"""Most jobs in one transaction: bounds how long the write lock is held and how long a group's last job
waits for its first."""
SQLITE_BEGIN = "BEGIN IMMEDIATE"


@dataclass
class _Job(Generic[_T]):
    fn: Callable[[Session], _T]
    caller: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[_T]
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    value: Any = None
    error: BaseException | None = None


@dataclass
class GroupStats:
    """What the writer has done since it started (read by metrics and benches; updated on its thread)."""

    groups: int = 0
    jobs: int = 0
    largest: int = 0
    commit_failures: int = 0


class GroupCommitter:
    """One writer thread running queued write transactions in groups (see the module docstring)."""

    def __init__(self, sessions: SessionFactory, *, begin_sql: str | None = None,
                 max_group: int = DEFAULT_MAX_GROUP, name: str = "carpool-group-commit") -> None:
        """`begin_sql`: the statement that opens each group's transaction (`SQLITE_BEGIN` on SQLite; None
        where the driver opens one itself, as psycopg does)."""
        if max_group < 1:
            raise ValueError(f"max_group must be >= 1, got {max_group}")
        self._sessions = sessions
        self._begin_sql = begin_sql
        self._max_group = max_group
        self._name = name
        self._cond = threading.Condition()
        """Guards `_waiting`, `_thread` and `_closed`; the writer waits on it for work."""
        self._waiting: OrderedDict[str, deque[_Job[Any]]] = OrderedDict()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.stats = GroupStats()

    async def run(self, fn: Callable[[Session], _T], *, caller: str = "") -> _T:
        """Run `fn(session)` in the next group; its return value or exception comes back here."""
        loop = asyncio.get_running_loop()
        job: _Job[_T] = _Job(fn, caller, loop, loop.create_future())
        with self._cond:
            if self._closed:
                raise RuntimeError("the group committer is closed")
            self._waiting.setdefault(caller, deque()).append(job)
            self._start_thread()
            self._cond.notify()
        return await job.future

    def close(self) -> None:
        """Finish the queued jobs, then stop the writer thread (idempotent)."""
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while group := self._next_group():
            self._run_group(group)

    def _next_group(self) -> list[_Job[Any]]:
        """Up to `max_group` queued jobs, one per caller per sweep (callers served in turn); waits for one to
        be queued, and returns [] once closed with nothing left."""
        group: list[_Job[Any]] = []
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            while self._waiting and len(group) < self._max_group:
                caller, jobs = next(iter(self._waiting.items()))
                group.append(jobs.popleft())
                del self._waiting[caller]
                if jobs:  # to the back of the line
                    self._waiting[caller] = jobs
        return group

    def _run_group(self, group: list[_Job[Any]]) -> None:
        try:
            with self._sessions.begin() as session:
                if self._begin_sql is not None:
                    session.connection().exec_driver_sql(self._begin_sql)
                if len(group) == 1:
                    _run_alone(session, group[0])
                else:
                    for job in group:
                        _run_job(session, job)
        except _LoneJobFailed:
            pass  # rolled back; the job has its error
        except BaseException as exc:  # BEGIN or COMMIT failed: nothing of the group was written
            self.stats.commit_failures += 1
            for job in group:
                if job.error is None:
                    job.value, job.error = None, exc
        self.stats.groups += 1
        self.stats.jobs += len(group)
        self.stats.largest = max(self.stats.largest, len(group))
        _deliver(group)


class _LoneJobFailed(Exception):
    """Rolls a group of one back: its job failed (the job carries the error)."""


def _run_alone(session: Session, job: _Job[Any]) -> None:
    """A group of one needs no savepoint: the job's error rolls the whole transaction back, which is exactly
    its own writes (a lone submission, the usual case below saturation, skips two statements)."""
    try:
        job.value = job.context.run(job.fn, session)
    except Exception as exc:
        job.error = exc
        raise _LoneJobFailed from exc


def _run_job(session: Session, job: _Job[Any]) -> None:
    try:
        with session.begin_nested():
            job.value = job.context.run(job.fn, session)
    except Exception as exc:  # the job's own error: its savepoint is rolled back, the group goes on
        job.error = exc


def _deliver(group: list[_Job[Any]]) -> None:
    """Each loop's futures resolved by one callback (one wake-up of that loop per group, not per job)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Job[Any]]] = {}
    for job in group:
        by_loop.setdefault(job.loop, []).append(job)
    for loop, jobs in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
            loop.call_soon_threadsafe(_resolve, jobs)


def _resolve(jobs: list[_Job[Any]]) -> None:
    for job in jobs:
        if job.future.done():  # the caller was cancelled meanwhile
            continue
        if job.error is not None:
            job.future.set_exception(job.error)
        else:
            job.future.set_result(job.value)
