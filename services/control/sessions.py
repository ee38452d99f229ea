"""Client sessions: create, heartbeat, finish, and the session listings of the REST API."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from services.auth.tenants import Tenant
from services.control.api import NotFound, Page, SessionView
from services.control.context import ControlContext, count_sessions, not_found
from services.control.ownership import OwnedFacts
from services.db.ids import ModelId, SamplingSessionId, SessionId, TenantId
from services.db.runs import list_sampling_sessions, list_training_runs
from services.db.sessions import create_session, finish_session, get_session, list_sessions, record_heartbeat
from services.db.statements import MAX_PAGE_SIZE

MAX_CHILDREN = MAX_PAGE_SIZE
"""Runs and samplers listed per session view (the API has no cursor there)."""
HEARTBEAT_WRITE_INTERVAL_S = 30.0
"""The shortest interval at which a session's `last_heartbeat_at` is written (the beats between are checked
by a read, or not at all); `heartbeat_write_interval` gives the service's."""
MAX_HEARTBEAT_WRITE_INTERVAL_S = 300.0
STALE_TO_WRITE_RATIO = 12.0


def heartbeat_write_interval(stale_session_s: float) -> float:
    """How often a live session's beat is written, for a sweeper that finishes sessions silent for
    `stale_session_s`: a twelfth of that, between 30 s and 300 s (the default hour gives 300 s).

    A live session's recorded beat is then at most this + the SDK's 10 s period old, far inside the sweeper's
    limit. Nothing else reads the column at a finer grain, and at 512 SDK clients (50 beats a second) the
    writes every 30 s were a third of all beats, each taking SQLite's one write lock from the submissions."""
    return min(MAX_HEARTBEAT_WRITE_INTERVAL_S, max(HEARTBEAT_WRITE_INTERVAL_S, stale_session_s / STALE_TO_WRITE_RATIO))


class SessionOps:
    def __init__(self, ctx: ControlContext, write_interval_s: float = HEARTBEAT_WRITE_INTERVAL_S) -> None:
        self._ctx = ctx
        self._write_interval = timedelta(seconds=write_interval_s)
        self._beats: OwnedFacts[datetime] = OwnedFacts()
        """Per live session of a tenant, its recorded heartbeat as this process last wrote or read it. The SDK
        beats every 10 s per client, so with hundreds of clients heartbeats were a sixth of the gateway's
        database work (py-spy, 512 tenants), though two of three only read a fresh time. Only the caller's
        own live session is remembered: a foreign, unknown or finished one is looked up every time."""

    async def create_session(self, tenant: Tenant, *, tags: list[str], user_metadata: dict[str, object],
                             sdk_version: str | None, project_id: str | None) -> SessionId:
        now = self._ctx.clock()

        def tx(db: Session) -> SessionId:
            self._ctx.quotas.check_sessions(db, tenant)
            row = create_session(db, TenantId(tenant.id), tags=tags, user_metadata=dict(user_metadata or {}),
                                 sdk_version=sdk_version, project_id=project_id, now=now)
            return SessionId(row.id)

        session_id = await self._ctx.tx(tx)
        # Created with its first beat recorded: the client's first heartbeats need no transaction either.
        self._beats.remember(tenant.id, session_id, now)
        return session_id

    async def heartbeat(self, tenant: Tenant, session_id: SessionId) -> None:
        """Mark the session alive: a write at most every write interval, and no transaction at all while this
        process knows the recorded beat is younger than that (`_beats`)."""
        now = self._ctx.clock()
        recorded = self._beats.get(tenant.id, session_id)
        if recorded is not None and now - recorded < self._write_interval:
            return  # the database would only be read, and answer "alive"

        def tx(db: Session) -> tuple[bool, datetime | None]:
            beat = record_heartbeat(db, TenantId(tenant.id), session_id, now=now,
                                    min_interval_s=self._write_interval.total_seconds())
            # A finished session's heartbeat is harmless; only an unknown one is an error.
            return beat is not None or get_session(db, TenantId(tenant.id), session_id) is not None, beat

        found, beat = await self._ctx.tx(tx)
        if not found:
            raise NotFound(not_found("session", session_id), field="session_id")
        if beat is not None:
            self._beats.remember(tenant.id, session_id, beat)

    async def finish_session(self, tenant: Tenant, session_id: SessionId) -> None:
        found = await self._ctx.tx(
            lambda db: finish_session(db, TenantId(tenant.id), session_id, now=self._ctx.clock())
        )
        if not found:
            raise NotFound(not_found("session", session_id), field="session_id")

    async def list_sessions(self, tenant: Tenant, limit: int, offset: int) -> tuple[list[SessionId], Page]:
        def tx(db: Session) -> tuple[list[SessionId], int]:
            rows = list_sessions(db, TenantId(tenant.id), limit=limit, offset=offset)
            return [SessionId(r.id) for r in rows], count_sessions(db, TenantId(tenant.id))

        ids, total = await self._ctx.tx(tx)
        return ids, Page(offset=offset, limit=limit, total_count=total)

    async def get_session(self, tenant: Tenant, session_id: SessionId) -> SessionView:
        def tx(db: Session) -> SessionView | None:
            tenant_id = TenantId(tenant.id)
            row = get_session(db, tenant_id, session_id)
            if row is None:
                return None
            runs = list_training_runs(db, tenant_id, session_id=session_id, limit=MAX_CHILDREN)
            samplers = list_sampling_sessions(db, tenant_id, session_id=session_id, limit=MAX_CHILDREN)
            return SessionView(
                session_id=SessionId(row.id),
                training_run_ids=[ModelId(r.id) for r in runs],
                sampler_ids=[SamplingSessionId(s.id) for s in samplers],
                user_metadata={str(k): str(v) for k, v in (row.user_metadata or {}).items()},
            )

        view = await self._ctx.tx(tx)
        if view is None:
            raise NotFound(not_found("session", session_id), field="session_id")
        return view
