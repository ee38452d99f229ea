"""Session heartbeats: a write at most every 30 s (in the service a twelfth of its stale-session limit,
300 s by default), and no transaction while this process knows the recorded beat is younger than that. The
SDK beats every 10 s per client; with hundreds of clients heartbeats were a sixth of the gateway's database
work. Answers stay what the database gives: a foreign or unknown session is 404 every time, a finished one
is harmless (no error)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session

from deploy.embedded import _control_options
from deploy.settings import ServiceSettings
from services.auth.tenants import Tenant
from services.control.api import NotFound
from services.control.sessions import SessionOps, heartbeat_write_interval
from services.db import database_url_for_data_dir, open_database
from services.db.database import Database
from services.db.ids import SessionId
from services.db.sessions import create_session, finish_session, get_session
from services.db.tenants import create_tenant

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


@dataclass
class FakeContext:
    """What `SessionOps` uses of the control context: transactions (counted) and the clock."""

    db: Database
    now: datetime = T0
    transactions: int = 0
    clock: Callable[[], datetime] = field(init=False)
    quotas: Any = field(init=False)

    def __post_init__(self) -> None:
        self.clock = lambda: self.now
        self.quotas = type("NoQuotas", (), {"check_sessions": staticmethod(lambda db, tenant: None)})()

    async def tx(self, fn: Callable[[Session], Any]) -> Any:
        self.transactions += 1
        with self.db.sessions.begin() as session:
            return fn(session)


@pytest.fixture
def ctx(tmp_path: Path) -> FakeContext:
    return FakeContext(open_database(database_url_for_data_dir(tmp_path), migrate=True))


def _tenant(ctx: FakeContext, name: str) -> tuple[Tenant, SessionId]:
    with ctx.db.sessions.begin() as db:
        row = create_tenant(db, name)
        tenant = Tenant.from_row(row)
        session = SessionId(create_session(db, tenant.id, now=T0).id)
    return tenant, session


def _recorded(ctx: FakeContext, tenant: Tenant, session: SessionId) -> datetime:
    with ctx.db.sessions.begin() as db:
        row = get_session(db, tenant.id, session)
        assert row is not None and row.last_heartbeat_at is not None
        return row.last_heartbeat_at.replace(tzinfo=UTC)


def test_beats_within_the_write_interval_need_no_transaction(ctx: FakeContext) -> None:
    ops, (tenant, session) = SessionOps(ctx), _tenant(ctx, "a")  # type: ignore[arg-type]
    ctx.now = T0 + timedelta(seconds=40)
    asyncio.run(ops.heartbeat(tenant, session))  # recorded beat (T0) is 40 s old: written
    assert ctx.transactions == 1 and _recorded(ctx, tenant, session) == ctx.now
    for seconds in (50, 60, 69):  # 10, 20 and 29 s after the write: known fresh, nothing to ask
        ctx.now = T0 + timedelta(seconds=seconds)
        asyncio.run(ops.heartbeat(tenant, session))
    assert ctx.transactions == 1
    ctx.now = T0 + timedelta(seconds=71)  # 31 s after the write: written again
    asyncio.run(ops.heartbeat(tenant, session))
    assert ctx.transactions == 2 and _recorded(ctx, tenant, session) == ctx.now


def test_a_beat_another_process_recorded_counts_from_its_own_time(ctx: FakeContext) -> None:
    tenant, session = _tenant(ctx, "a")
    ops = SessionOps(ctx)  # type: ignore[arg-type]
    ctx.now = T0 + timedelta(seconds=20)  # the recorded beat (T0, the session's creation) is fresh: read
    asyncio.run(ops.heartbeat(tenant, session))
    ctx.now = T0 + timedelta(seconds=29)
    asyncio.run(ops.heartbeat(tenant, session))
    assert ctx.transactions == 1
    ctx.now = T0 + timedelta(seconds=31)  # 31 s after the recorded beat, though only 11 s after the read
    asyncio.run(ops.heartbeat(tenant, session))
    assert ctx.transactions == 2 and _recorded(ctx, tenant, session) == ctx.now


def test_foreign_and_unknown_sessions_are_looked_up_every_time(ctx: FakeContext) -> None:
    ops = SessionOps(ctx)  # type: ignore[arg-type]
    (owner, session), (other, _) = _tenant(ctx, "a"), _tenant(ctx, "b")
    asyncio.run(ops.heartbeat(owner, session))
    before = ctx.transactions
    for _ in range(2):
        for tenant, sid in ((other, session), (owner, SessionId("sess-missing"))):
            with pytest.raises(NotFound):
                asyncio.run(ops.heartbeat(tenant, sid))
    assert ctx.transactions == before + 4


def test_a_finished_session_beats_harmlessly(ctx: FakeContext) -> None:
    ops, (tenant, session) = SessionOps(ctx), _tenant(ctx, "a")  # type: ignore[arg-type]
    with ctx.db.sessions.begin() as db:
        finish_session(db, tenant.id, session, now=T0)
    for _ in range(2):
        asyncio.run(ops.heartbeat(tenant, session))  # no error, and nothing remembered: looked up each time
    assert ctx.transactions == 2


def test_a_session_created_here_needs_no_transaction_for_its_first_beats(ctx: FakeContext) -> None:
    """The session row is created with its first beat recorded; at hundreds of new clients their first
    heartbeats were still a transaction each."""
    with ctx.db.sessions.begin() as db:
        tenant = Tenant.from_row(create_tenant(db, "new"))
    ops = SessionOps(ctx)  # type: ignore[arg-type]
    session = asyncio.run(ops.create_session(tenant, tags=[], user_metadata={}, sdk_version=None, project_id=None))
    assert ctx.transactions == 1
    for seconds in (10, 20, 29):
        ctx.now = T0 + timedelta(seconds=seconds)
        asyncio.run(ops.heartbeat(tenant, session))
    assert ctx.transactions == 1
    ctx.now = T0 + timedelta(seconds=31)
    asyncio.run(ops.heartbeat(tenant, session))
    assert ctx.transactions == 2 and _recorded(ctx, tenant, session) == ctx.now


def test_the_service_writes_a_beat_a_twelfth_of_its_stale_limit_apart(ctx: FakeContext, tmp_path: Path) -> None:
    """At 512 SDK clients (50 beats a second) a write every 30 s was a third of all beats, each taking
    SQLite's write lock from the submissions; the sweeper only compares the column against an hour."""
    assert [heartbeat_write_interval(s) for s in (60, 1200, 3600, 86400)] == [30.0, 100.0, 300.0, 300.0]
    assert _control_options(ServiceSettings(data_dir=tmp_path)).heartbeat_write_s == 300.0
    tenant, session = _tenant(ctx, "a")
    ops = SessionOps(ctx, heartbeat_write_interval(3600))  # type: ignore[arg-type]
    for seconds in (10, 100, 200, 299):  # the creation's beat is fresh: read once, then known
        ctx.now = T0 + timedelta(seconds=seconds)
        asyncio.run(ops.heartbeat(tenant, session))
    assert ctx.transactions == 1 and _recorded(ctx, tenant, session) == T0
    ctx.now = T0 + timedelta(seconds=301)
    asyncio.run(ops.heartbeat(tenant, session))
    assert ctx.transactions == 2 and _recorded(ctx, tenant, session) == ctx.now
