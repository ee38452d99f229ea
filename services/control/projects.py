"""Sessions and projects of the SDK's `RestClient`: `assign_session_project`, `search_sessions`, and
`export_session_trace`.

A project is a tenant's own label on its sessions (`sessions.project_id`); runs and checkpoints belong to the
project of their session, so listings filter through it. Search matches the tenant's sessions only (the
`accessible` / other-owner scopes of the hosted service collapse to the caller's, since tenants never share
sessions). A trace export is answered at once: a signed link (a short-lived JWT, no API key needed) to the
session's requests as a Chrome/Perfetto trace built from the request log when it is fetched: queued and
running spans per training run and sampling session, with request id, pass id and tokens — the same rows the
dashboard's timeline reads.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from services.auth.tenants import Tenant
from services.control.api import NotFound, Page, TrainingRunView
from services.control.billing import audit
from services.control.catalog import run_view
from services.control.context import ControlContext, not_found
from services.control.jwt_tokens import TokenSigner
from services.control.surface_views import SessionSearch, SessionSummaryView, TraceExport
from services.db.ids import SessionId, TenantId
from services.db.models import RequestRow
from services.db.sdk_surface import (
    SessionQuery,
    assign_project,
    project_runs,
    search_sessions,
    session_checkpoints,
    session_requests,
)
from services.db.sessions import get_session

DEFAULT_PROJECT = "default"
"""The project a session without one belongs to (the SDK's `SessionSummary.project_id` is required)."""
MAX_TRACE_REQUESTS = 20_000
TRACE_ROUTE = "/api/v1/trace"


class ProjectOps:
    def __init__(self, ctx: ControlContext, signer: TokenSigner) -> None:
        self._ctx = ctx
        self._signer = signer

    async def assign_session_project(self, tenant: Tenant, session_id: SessionId, project_id: str) -> None:
        def tx(db: Session) -> bool:
            if not assign_project(db, TenantId(tenant.id), session_id, project_id):
                return False
            audit(db, tenant, action="project_set", target_type="session", target_id=session_id,
                  detail={"project_id": project_id})
            return True

        if not await self._ctx.tx(tx):
            raise NotFound(not_found("session", session_id), field="session_id")

    async def project_runs(self, tenant: Tenant, project_id: str, limit: int,
                           offset: int) -> tuple[list[TrainingRunView], Page]:
        """`training_runs?project_id=`: the runs of the project's sessions."""
        def tx(db: Session) -> tuple[list[TrainingRunView], int]:
            rows, total = project_runs(db, TenantId(tenant.id), project_id, DEFAULT_PROJECT, limit, offset)
            return [run_view(db, r) for r in rows], total

        views, total = await self._ctx.tx(tx)
        return views, Page(offset=offset, limit=limit, total_count=total)

    async def search_sessions(self, tenant: Tenant, search: SessionSearch) -> list[SessionSummaryView]:
        query = SessionQuery(session_id=search.session_id, display_name=search.display_name,
                             project_ids=search.project_ids, user_metadata=search.user_metadata,
                             unassigned_project=DEFAULT_PROJECT,
                             statuses=search.statuses, before=search.after, limit=search.limit)

        def tx(db: Session) -> list[SessionSummaryView]:
            rows = search_sessions(db, TenantId(tenant.id), query)
            sizes = session_checkpoints(db, [r.id for r in rows])
            return [SessionSummaryView(
                session_id=r.id, created_at=r.created_at, owner=f"tml:user:{tenant.id}",
                project_id=r.project_id or DEFAULT_PROJECT, finished=r.finished_at is not None,
                checkpoints_count=sizes.get(r.id, (0, 0))[0], checkpoint_storage_bytes=sizes.get(r.id, (0, 0))[1],
                display_name=r.display_name, user_metadata={str(k): str(v) for k, v in (r.user_metadata or {}).items()},
            ) for r in rows]

        return await self._ctx.tx(tx)

    async def export_session_trace(self, tenant: Tenant, session_id: SessionId, base_url: str) -> TraceExport:
        found = await self._ctx.tx(lambda db: get_session(db, TenantId(tenant.id), session_id) is not None)
        if not found:
            raise NotFound(not_found("session", session_id), field="session_id")
        token = self._signer.mint_trace_link(tenant.id, session_id)
        return TraceExport(url=f"{base_url.rstrip('/')}{TRACE_ROUTE}/{token}")

    async def session_trace(self, token: str) -> dict[str, Any]:
        """The trace a signed link names (raises NotFound for a bad or expired link)."""
        checked = self._signer.check_trace_link(token)
        if checked is None:
            raise NotFound("trace link is invalid or expired", field="token")
        tenant_id, session_id = checked
        rows = await self._ctx.tx(lambda db: session_requests(db, TenantId(tenant_id), SessionId(session_id),
                                                              MAX_TRACE_REQUESTS))
        return chrome_trace(session_id, rows)


def _us(ts: datetime) -> int:
    aware = ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)
    return int(aware.timestamp() * 1_000_000)


def chrome_trace(session_id: str, rows: list[RequestRow]) -> dict[str, Any]:
    """Chrome Trace Event JSON (opens in ui.perfetto.dev): one track per training run / sampling session,
    a `queued` span then a running span per request."""
    lanes: dict[str, int] = {}
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0,
                                     "args": {"name": f"session {session_id}"}}]
    for row in rows:
        lane_name = row.model_id or row.sampling_session_id or "session"
        if lane_name not in lanes:
            lanes[lane_name] = len(lanes) + 1
            events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": lanes[lane_name],
                           "args": {"name": lane_name}})
        events.extend(_request_spans(row, lanes[lane_name]))
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"session_id": session_id}}


def _request_spans(row: RequestRow, tid: int) -> list[dict[str, Any]]:
    created = _us(row.created_at)
    started = _us(row.started_at) if row.started_at is not None else None
    finished = _us(row.finished_at) if row.finished_at is not None else None
    args = {"request_id": row.id, "status": row.status, "seq_id": row.seq_id, "pass_id": row.pass_id,
            "tokens": row.num_tokens}
    queued_end = started if started is not None else finished
    spans = []
    if queued_end is not None and queued_end > created:
        spans.append({"ph": "X", "cat": "queued", "name": f"queued {row.kind}", "pid": 1, "tid": tid,
                      "ts": created, "dur": queued_end - created, "args": args})
    if started is not None and finished is not None:
        spans.append({"ph": "X", "cat": "running", "name": row.kind, "pid": 1, "tid": tid, "ts": started,
                      "dur": max(1, finished - started), "args": args})
    elif queued_end is None:
        spans.append({"ph": "i", "cat": row.status, "name": f"{row.kind} ({row.status})", "pid": 1, "tid": tid,
                      "ts": created, "s": "t", "args": args})
    return spans
