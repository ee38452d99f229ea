"""Repository for the audit log: who created or revoked a key, changed a quota, disabled a tenant, and when.

Written by the operator actions themselves (the `carpool` CLI and the admin dashboard alike), in the same
transaction as the change they record, so an action and its record commit or roll back together. Reads
page by id (`before_id`), which stays fast and stable while new rows are appended.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.db.columns import utcnow
from services.db.models import AuditLogRow
from services.db.statements import MAX_PAGE_SIZE

DETAIL_MAX_CHARS = 2000
"""Details are short (old and new quota values, a key prefix); a longer string is cut, not refused."""


@dataclass(frozen=True)
class AuditEntry:
    """One recorded action, detached from the database session."""

    id: int
    created_at: datetime
    actor_tenant_id: str | None
    actor_key_prefix: str | None
    action: str
    target_type: str
    target_id: str
    tenant_id: str | None
    detail: dict[str, Any]


def record_audit(
    session: Session,
    *,
    action: str,
    target_type: str,
    target_id: str,
    actor_tenant_id: str | None,
    actor_key_prefix: str | None,
    tenant_id: str | None,
    detail: dict[str, Any] | None,
) -> None:
    """Append one entry (flushed, not committed: it commits with the action it records)."""
    row = AuditLogRow(
        created_at=utcnow(),
        actor_tenant_id=actor_tenant_id,
        actor_key_prefix=actor_key_prefix,
        action=action,
        target_type=target_type,
        target_id=target_id,
        tenant_id=tenant_id,
        detail={k: _bounded(v) for k, v in (detail or {}).items()},
    )
    session.add(row)
    session.flush()


def list_audit(
    session: Session, *, tenant_id: str | None, limit: int, before_id: int | None
) -> list[AuditEntry]:
    """Newest first; only entries affecting `tenant_id` when given; `before_id` continues a listing."""
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise ValueError(f"limit must be in [1, {MAX_PAGE_SIZE}], got {limit}")
    stmt = select(AuditLogRow)
    if tenant_id is not None:
        stmt = stmt.where(AuditLogRow.tenant_id == tenant_id)
    if before_id is not None:
        stmt = stmt.where(AuditLogRow.id < before_id)
    rows = session.scalars(stmt.order_by(AuditLogRow.id.desc()).limit(limit))
    return [_entry(row) for row in rows]


def _entry(row: AuditLogRow) -> AuditEntry:
    return AuditEntry(
        id=row.id,
        created_at=row.created_at,
        actor_tenant_id=row.actor_tenant_id,
        actor_key_prefix=row.actor_key_prefix,
        action=row.action,
        target_type=row.target_type,
        target_id=row.target_id,
        tenant_id=row.tenant_id,
        detail=dict(row.detail or {}),
    )


def _bounded(value: Any) -> Any:
    if isinstance(value, str) and len(value) > DETAIL_MAX_CHARS:
        return value[:DETAIL_MAX_CHARS] + "…"
    return value
