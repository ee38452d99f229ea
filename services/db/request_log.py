"""Repository for the request log: one row per API call, tracking queued → running → done|failed.

Only metadata is kept (kind, timing, token count, error); payloads travel through the queue, not here.
Transitions are conditional UPDATEs, so a late or duplicated status report from a worker cannot move a
finished request back to running or overwrite how it ended.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Table, Update, bindparam, func, insert, literal_column, or_, select, update
from sqlalchemy.orm import Session

from services.db.columns import utcnow
from services.db.ids import ModelId, RequestId, SamplingSessionId, TenantId, new_request_id
from services.db.models import RequestRow, RequestStatus
from services.db.prepared import PreparedStatement
from services.db.statements import DEFAULT_PAGE_SIZE, execute_count, paginate

UNFINISHED: tuple[RequestStatus, ...] = ("queued", "running")

_TABLE: Table = RequestRow.__table__  # type: ignore[assignment]
_INSERTED = ("id", "tenant_id", "model_id", "sampling_session_id", "kind", "seq_id", "status", "created_at")
_INSERT = PreparedStatement(insert(_TABLE), column_keys=_INSERTED)


def status_in(column: ColumnElement[Any], statuses: tuple[RequestStatus, ...]) -> ColumnElement[bool]:
    """`column IN (statuses)` with the statuses spelled out as literals: a prepared statement (and an
    executemany) takes no expanding IN parameter."""
    return or_(*(column == literal_column(f"'{status}'") for status in statuses))


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
    """Log a newly accepted request as queued; returns the row as written (not attached to the session).

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
    _INSERT.execute(db, {column: getattr(row, column) for column in _INSERTED})
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
    keep_existing: tuple[str, ...] = (),
) -> bool:
    """The conditional UPDATE; columns in `keep_existing` are only set where still NULL."""
    stmt = _transition_statement(allowed_from, tuple(sorted(values)), keep_existing)
    params = {"w_id": request_id, "w_tenant_id": tenant_id, **{f"v_{k}": v for k, v in values.items()}}
    return stmt.execute_count(db, params) == 1


@functools.cache
def _transition_statement(
    allowed_from: tuple[RequestStatus, ...], columns: tuple[str, ...], keep_existing: tuple[str, ...],
) -> PreparedStatement:
    """Built once per shape (a handful: one per transition and optional column set)."""
    return PreparedStatement(_transition_update(allowed_from, columns, keep_existing))


def _transition_update(
    allowed_from: tuple[RequestStatus, ...], columns: tuple[str, ...], keep_existing: tuple[str, ...],
) -> Update:
    table = _TABLE
    values: dict[str, ColumnElement[Any]] = {}
    for name in columns:
        param = bindparam(f"v_{name}", type_=table.c[name].type)
        values[name] = func.coalesce(table.c[name], param) if name in keep_existing else param
    allowed = status_in(table.c.status, allowed_from)
    return (
        update(table)
        .where(table.c.id == bindparam("w_id"), table.c.tenant_id == bindparam("w_tenant_id"), allowed)
        .values(values)
    )


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
    started_at: datetime | None = None,
    now: datetime | None = None,
    loss: float | None = None,
) -> bool:
    """queued|running → done (a request may finish without a separate running report; `started_at` then
    records when it started, unless a running report already did). `loss`: a training pass's `loss:sum`."""
    values: dict[str, object] = {"status": "done", "finished_at": now or utcnow(), "num_tokens": num_tokens}
    if loss is not None:
        values["loss"] = loss
    _set_run_info(values, pass_id, started_at)
    # A running report's start time, if there was one, stays: it is the more precise of the two.
    return _transition(db, tenant_id, request_id, UNFINISHED, values, keep_existing=("started_at",))


@dataclass(frozen=True)
class DoneMark:
    """One request of a finished plan item, for `mark_requests_done`."""

    tenant_id: TenantId
    request_id: RequestId
    num_tokens: int | None = None
    loss: float | None = None


def mark_requests_done(db: Session, marks: Sequence[DoneMark], *, pass_id: str | None = None,
                       started_at: datetime | None = None, now: datetime | None = None) -> None:
    """`mark_request_done` for all requests of one plan item: one executemany per statement shape (two at
    most: with and without a loss) instead of a statement each, which the loop thread paid per tenant."""
    finished_at = now or utcnow()
    groups: dict[tuple[str, ...], list[dict[str, object]]] = {}
    for mark in marks:
        values: dict[str, object] = {"status": "done", "finished_at": finished_at, "num_tokens": mark.num_tokens}
        if mark.loss is not None:
            values["loss"] = mark.loss
        _set_run_info(values, pass_id, started_at)
        params = {"w_id": mark.request_id, "w_tenant_id": mark.tenant_id, **{f"v_{k}": v for k, v in values.items()}}
        groups.setdefault(tuple(sorted(values)), []).append(params)
    for columns, rows in groups.items():
        _transition_statement(UNFINISHED, columns, ("started_at",)).executemany(db, rows)


def mark_request_failed(
    db: Session,
    tenant_id: TenantId,
    request_id: RequestId,
    *,
    error: str,
    category: str = "unknown",
    pass_id: str | None = None,
    started_at: datetime | None = None,
    now: datetime | None = None,
) -> bool:
    """queued|running → failed, with Tinker's error category (unknown/server/user); `pass_id` and
    `started_at` as for `mark_request_done` (for a request that ran)."""
    values: dict[str, object] = {
        "status": "failed",
        "finished_at": now or utcnow(),
        "error": error,
        "category": category,
    }
    _set_run_info(values, pass_id, started_at)
    # A running report's start time, if there was one, stays: it is the more precise of the two.
    return _transition(db, tenant_id, request_id, UNFINISHED, values, keep_existing=("started_at",))


def _set_run_info(values: dict[str, object], pass_id: str | None, started_at: datetime | None) -> None:
    if pass_id is not None:
        values["pass_id"] = pass_id
    if started_at is not None:
        values["started_at"] = started_at


def fail_unfinished_requests(
    db: Session, *, error: str, category: str = "server", now: datetime | None = None
) -> int:
    """Fail every queued or running request of every tenant; returns how many.

    Cross-tenant by design: run at server startup, when work that was in flight before a crash is gone.
    """
    stmt = update(RequestRow).where(RequestRow.status.in_(UNFINISHED))
    values = {"status": "failed", "finished_at": now or utcnow(), "error": error, "category": category}
    return execute_count(db, stmt.values(**values))
