"""Sessions as the SDK's `RestClient` manages them beyond listing: projects, search, and trace export.

- `PUT sessions/{id}/project` moves a session (and its runs and checkpoints) to a project (`{"project_id"}`).
- `POST sessions/search`: the caller's sessions by id, display name (every word, case-insensitive),
  projects, user metadata and status, newest first with a cursor.
- `GET sessions/{id}/trace_export` answers `ready` at once with a signed link; `GET trace/{token}` (no API key:
  the signed token is the credential, valid an hour) serves the session's requests as Chrome/Perfetto trace
  JSON, built from the request log when fetched.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from gateway.deps import Control, CurrentTenant, PublicBaseUrl, RawBody, documents_body, parse_body
from gateway.rendering import wire_json
from services.control.surface_views import SessionSearch, SessionSummaryView
from services.db.ids import SessionId
from services.wire.admin import (
    SessionSearchCursorOut,
    SessionSearchRequest,
    SessionSearchResponse,
    SessionStatusWire,
    SessionSummary,
)
from services.wire.errors import WireError
from services.wire.rest import AssignSessionProjectRequest, SessionTraceExportResponse

router = APIRouter(prefix="/api/v1", tags=["sessions"])


@router.put("/sessions/{session_id}/project", status_code=204)
@documents_body(AssignSessionProjectRequest)
async def assign_session_project(session_id: str, tenant: CurrentTenant, control: Control,
                                 body: RawBody) -> Response:
    """Move a session to a project; listings filtered by `project_id` then include its runs."""
    request = parse_body(AssignSessionProjectRequest, body)
    await control.assign_session_project(tenant, SessionId(session_id), request.project_id)
    return Response(status_code=204)


@router.get("/sessions/{session_id}/trace_export", response_model=SessionTraceExportResponse)
async def export_session_trace(session_id: str, tenant: CurrentTenant, control: Control,
                               base_url: PublicBaseUrl) -> JSONResponse:
    """A signed link to the session's trace (Chrome trace JSON; opens in ui.perfetto.dev)."""
    export = await control.export_session_trace(tenant, SessionId(session_id), base_url)
    return wire_json(SessionTraceExportResponse(status="ready", url=export.url))


@router.get("/trace/{token}", tags=["download"])
async def session_trace(token: str, control: Control) -> JSONResponse:
    """The trace a signed link names; no API key (the token is the credential)."""
    trace = await control.session_trace(token)
    return JSONResponse(trace, headers={"Content-Disposition": 'attachment; filename="session.pftrace.json"'})


@router.post("/sessions/search", response_model=SessionSearchResponse)
@documents_body(SessionSearchRequest)
async def search_sessions(tenant: CurrentTenant, control: Control, body: RawBody) -> JSONResponse:
    """The caller's sessions matching every given filter, newest first; `next_cursor` continues."""
    request = parse_body(SessionSearchRequest, body)
    if request.owner.type == "user" and any(urn != f"tml:user:{tenant.id}" for urn in request.owner.owner_urns or []):
        raise WireError("owner.owner_urns", "only the caller's own sessions can be searched")
    statuses = None if request.statuses is None else [s.type for s in request.statuses]
    cursor = request.cursor
    search = SessionSearch(
        session_id=request.session_id, display_name=request.display_name, project_ids=request.project_ids,
        user_metadata=dict(request.user_metadata), statuses=statuses, limit=request.limit,
        after=(cursor.last_created_at, cursor.last_session_id) if cursor else None,
    )
    views = await control.search_sessions(tenant, search)
    next_cursor = None
    if len(views) == request.limit:
        last = views[-1]
        next_cursor = SessionSearchCursorOut(last_created_at=last.created_at, last_session_id=last.session_id)
    return wire_json(SessionSearchResponse(sessions=[_summary(v) for v in views], next_cursor=next_cursor))


def _summary(view: SessionSummaryView) -> SessionSummary:
    status = SessionStatusWire(type="client_finished", reason={"type": "success"}) if view.finished \
        else SessionStatusWire(type="active")
    return SessionSummary(
        session_id=view.session_id, created_at=view.created_at, owner=view.owner, project_id=view.project_id,
        status=status, checkpoints_count=view.checkpoints_count, display_name=view.display_name,
        user_metadata=view.user_metadata or None, checkpoint_storage_bytes=view.checkpoint_storage_bytes,
    )
