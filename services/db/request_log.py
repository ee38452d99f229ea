"""Repository for the request log: one row per API call, tracking queued → running → done|failed.

Only metadata is kept (kind, timing, token count, error); payloads travel through the queue, not here.
Transitions are conditional UPDATEs, so a late or duplicated status report from a worker cannot move a
finished request back to running or overwrite how it ended.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from services.db.columns import utcnow
from services.db.ids import ModelId, RequestId, SamplingSessionId, TenantId, new_request_id
from services.db.models import RequestRow, RequestStatus
from services.db.statements import DEFAULT_PAGE_SIZE, execute_count, paginate

UNFINISHED: tuple[RequestStatus, ...] = ("queued", "running")


def record_request(
    db: Session,
    tenant_id: TenantId,
    kind: str,
    *,
    request_id: RequestId | None = None,
    model_id: ModelId | None = None,
    sampling_session_id: SamplingSessionId | None = None,
    seq_id: int | None = None,
    now: datetime | None = None,
) -> RequestRow:
    """Log a newly accepted request as queued.

    A second request with the same (model_id, seq_id) violates a unique constraint (IntegrityError):
    the caller is expected to have claimed `seq_id` through `runs.reserve_seq_id`.
    """
    row = RequestRow(
        id=request_id or new_request_id(),
        tenant_id=tenant_id,
        model_id=model_id,
        sampling_session_id=sampling_session_id,
        kind=kind,
        seq_id=seq_id,
        status="queued",
        created_at=now or utcnow(),
    )
    db.add(row)
    db.flush()
    return row


def get_request(db: Session, tenant_id: TenantId, request_id: RequestId) -> RequestRow | None:
    """The request if it exists and belongs to `tenant_id`, else None."""
    stmt = select(RequestRow).where(RequestRow.id == request_id, RequestRow.tenant_id == tenant_id)
    return db.scalars(stmt).one_or_none()


def list_requests(
    db: Session,
    tenant_id: TenantId,
    *,
    model_id: ModelId | None = None,
    status: RequestStatus | None = None,
    limit: int = DEFAULT_PAGE_SIZE,
    offset: int = 0,
) -> list[RequestRow]:
    """The tenant's requests, newest first, optionally for one run and/or in one status."""
    stmt = select(RequestRow).where(RequestRow.tenant_id == tenant_id)
    if model_id is not None:
        stmt = stmt.where(RequestRow.model_id == model_id)
    if status is not None:
        stmt = stmt.where(RequestRow.status == status)
    stmt = stmt.order_by(RequestRow.created_at.desc(), RequestRow.id.desc())
    return list(db.scalars(paginate(stmt, limit, offset)))


def count_unfinished_requests(db: Session, tenant_id: TenantId) -> int:
    """Queued plus running requests: what the `max_concurrent_requests` quota limits."""
    stmt = select(func.count()).where(RequestRow.tenant_id == tenant_id, RequestRow.status.in_(UNFINISHED))
    return int(db.scalar(stmt) or 0)


def _transition(
    db: Session,
    tenant_id: TenantId,
    request_id: RequestId,
    allowed_from: tuple[RequestStatus, ...],
    values: dict[str, object],
) -> bool:
    stmt = update(RequestRow).where(
        RequestRow.id == request_id,
        RequestRow.tenant_id == tenant_id,
        RequestRow.status.in_(allowed_from),
    )
    return execute_count(db, stmt.values(**values)) == 1


def mark_request_running(
    db: Session,
    tenant_id: TenantId,
    request_id: RequestId,
    *,
    pass_id: str | None = None,
    now: datetime | None = None,
) -> bool:
    """queued → running. False if the request is unknown to the tenant or no longer queued."""
    values: dict[str, object] = {"status": "running", "started_at": now or utcnow(), "pass_id": pass_id}
    return _transition(db, tenant_id, request_id, ("queued",), values)


def mark_request_done(
    db: Session,
    tenant_id: TenantId,
    request_id: RequestId,
    *,
    num_tokens: int | None = None,
    pass_id: str | None = None,
    now: datetime | None = None,
) -> bool:
    """queued|running → done (a request may finish without a separate running report)."""
    values: dict[str, object] = {"status": "done", "finished_at": now or utcnow(), "num_tokens": num_tokens}
    if pass_id is not None:
        values["pass_id"] = pass_id
    return _transition(db, tenant_id, request_id, UNFINISHED, values)


def mark_request_failed(
    db: Session,
    tenant_id: TenantId,
    request_id: RequestId,
    *,
    error: str,
    category: str = "unknown",
    now: datetime | None = None,
) -> bool:
    """queued|running → failed, with Tinker's error category (unknown/server/user)."""
    values: dict[str, object] = {
        "status": "failed",
        "finished_at": now or utcnow(),
        "error": error,
        "category": category,
    }
    return _transition(db, tenant_id, request_id, UNFINISHED, values)


def fail_unfinished_requests(
    db: Session, *, error: str, category: str = "server", now: datetime | None = None
) -> int:
    """Fail every queued or running request of every tenant; returns how many.

    Cross-tenant by design: run at server startup, when work that was in flight before a crash is gone.
    """
    stmt = update(RequestRow).where(RequestRow.status.in_(UNFINISHED))
    values = {"status": "failed", "finished_at": now or utcnow(), "error": error, "category": category}
    return execute_count(db, stmt.values(**values))
