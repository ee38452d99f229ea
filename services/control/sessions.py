"""Client sessions: create, heartbeat, finish, and the session listings of the REST API."""

from __future__ import annotations

from sqlalchemy.orm import Session

from services.auth.tenants import Tenant
from services.control.api import NotFound, Page, SessionView
from services.control.context import ControlContext, count_sessions, not_found
from services.db.ids import ModelId, SamplingSessionId, SessionId, TenantId
from services.db.runs import list_sampling_sessions, list_training_runs
from services.db.sessions import create_session, finish_session, get_session, heartbeat_session, list_sessions
from services.db.statements import MAX_PAGE_SIZE

MAX_CHILDREN = MAX_PAGE_SIZE
"""Runs and samplers listed per session view (the API has no cursor there)."""
HEARTBEAT_WRITE_INTERVAL_S = 30.0
"""A session's `last_heartbeat_at` is written at most this often (the beats between are checked by a read).
A live session's recorded beat is then at most this + the SDK's 10 s period old: `stale_session_seconds`
(default 3600) must stay well above that."""


class SessionOps:
    def __init__(self, ctx: ControlContext) -> None:
        self._ctx = ctx

    async def create_session(self, tenant: Tenant, *, tags: list[str], user_metadata: dict[str, object],
                             sdk_version: str | None, project_id: str | None) -> SessionId:
        def tx(db: Session) -> SessionId:
            self._ctx.quotas.check_sessions(db, tenant)
            row = create_session(db, TenantId(tenant.id), tags=tags, user_metadata=dict(user_metadata or {}),
                                 sdk_version=sdk_version, project_id=project_id, now=self._ctx.clock())
            return SessionId(row.id)

        return await self._ctx.tx(tx)

    async def heartbeat(self, tenant: Tenant, session_id: SessionId) -> None:
        def tx(db: Session) -> bool:
            if heartbeat_session(db, TenantId(tenant.id), session_id, now=self._ctx.clock(),
                                 min_interval_s=HEARTBEAT_WRITE_INTERVAL_S):
                return True
            # A finished session's heartbeat is harmless; only an unknown one is an error.
            return get_session(db, TenantId(tenant.id), session_id) is not None

        if not await self._ctx.tx(tx):
            raise NotFound(not_found("session", session_id), field="session_id")

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
