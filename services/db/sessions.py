"""Repository for Tinker client sessions: create, heartbeat, finish, list, and the stale-session sweep.

Every read takes the caller's `tenant_id` and treats another tenant's session as nonexistent (None).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from services.db.columns import utcnow
from services.db.ids import SessionId, TenantId, new_session_id
from services.db.models import SessionRow
from services.db.statements import DEFAULT_PAGE_SIZE, execute_count, paginate


def create_session(
    db: Session,
    tenant_id: TenantId,
    *,
    tags: Iterable[str] = (),
    user_metadata: dict[str, Any] | None = None,
    sdk_version: str | None = None,
    project_id: str | None = None,
    display_name: str | None = None,
    now: datetime | None = None,
) -> SessionRow:
    now = now or utcnow()
    row = SessionRow(
        id=new_session_id(),
        tenant_id=tenant_id,
        created_at=now,
        last_heartbeat_at=now,
        tags=list(tags),
        user_metadata=dict(user_metadata or {}),
        sdk_version=sdk_version,
        project_id=project_id,
        display_name=display_name,
    )
    db.add(row)
    db.flush()
    return row


def get_session(db: Session, tenant_id: TenantId, session_id: SessionId) -> SessionRow | None:
    """The session if it exists and belongs to `tenant_id`, else None."""
    stmt = select(SessionRow).where(SessionRow.id == session_id, SessionRow.tenant_id == tenant_id)
    return db.scalars(stmt).one_or_none()


def list_sessions(
    db: Session,
    tenant_id: TenantId,
    *,
    limit: int = DEFAULT_PAGE_SIZE,
    offset: int = 0,
    include_finished: bool = True,
) -> list[SessionRow]:
    """The tenant's sessions, newest first."""
    stmt = select(SessionRow).where(SessionRow.tenant_id == tenant_id)
    if not include_finished:
        stmt = stmt.where(SessionRow.finished_at.is_(None))
    stmt = stmt.order_by(SessionRow.created_at.desc(), SessionRow.id.desc())
    return list(db.scalars(paginate(stmt, limit, offset)))


def heartbeat_session(
    db: Session, tenant_id: TenantId, session_id: SessionId, *, now: datetime | None = None,
    min_interval_s: float = 0.0,
) -> bool:
    """Mark the session alive. False if it is unknown to this tenant or already finished (see `record_heartbeat`)."""
    return record_heartbeat(db, tenant_id, session_id, now=now, min_interval_s=min_interval_s) is not None


def record_heartbeat(
    db: Session, tenant_id: TenantId, session_id: SessionId, *, now: datetime | None = None,
    min_interval_s: float = 0.0,
) -> datetime | None:
    """Mark the session alive; returns its recorded heartbeat afterwards (None: unknown to this tenant, or
    finished).

    With `min_interval_s`, a live session whose recorded heartbeat is younger than that is only read (and
    that younger time returned): the SDK beats every 10 s per client, so with hundreds of clients the UPDATEs
    (writes, each taking SQLite's one write lock) were a large share of the gateway's database work, for a
    column the stale-session sweep compares against an hour."""
    now = now or utcnow()
    if min_interval_s > 0:
        row = db.execute(select(SessionRow.last_heartbeat_at, SessionRow.finished_at).where(
            SessionRow.id == session_id, SessionRow.tenant_id == tenant_id)).one_or_none()
        if row is None or row.finished_at is not None:
            return None
        if row.last_heartbeat_at is not None and now - row.last_heartbeat_at < timedelta(seconds=min_interval_s):
            return row.last_heartbeat_at
    stmt = update(SessionRow).where(
        SessionRow.id == session_id, SessionRow.tenant_id == tenant_id, SessionRow.finished_at.is_(None)
    )
    return now if execute_count(db, stmt.values(last_heartbeat_at=now)) == 1 else None


def finish_session(
    db: Session, tenant_id: TenantId, session_id: SessionId, *, now: datetime | None = None
) -> bool:
    """Mark the session finished (idempotent: finishing twice keeps the first time). False if unknown."""
    stmt = update(SessionRow).where(
        SessionRow.id == session_id, SessionRow.tenant_id == tenant_id, SessionRow.finished_at.is_(None)
    )
    db.execute(stmt.values(finished_at=now or utcnow()))
    return get_session(db, tenant_id, session_id) is not None


def find_stale_sessions(
    db: Session, *, heartbeat_before: datetime, limit: int = DEFAULT_PAGE_SIZE
) -> list[SessionRow]:
    """Unfinished sessions of any tenant whose last heartbeat is older than `heartbeat_before`.

    Deliberately cross-tenant: this feeds the server's reaper, never a tenant-facing endpoint.
    """
    stmt = (
        select(SessionRow)
        .where(SessionRow.finished_at.is_(None), SessionRow.last_heartbeat_at < heartbeat_before)
        .order_by(SessionRow.last_heartbeat_at, SessionRow.id)
    )
    return list(db.scalars(paginate(stmt, limit, 0)))
