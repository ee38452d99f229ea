"""Repository for hub pushes: exports of a tenant's checkpoint to Hugging Face or ModelScope.

A push row is created when the tenant asks for the export and moves queued → running → done|failed as
the exporter works on it. Only the owner of a checkpoint can push it.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from services.db.checkpoints import get_checkpoint
from services.db.columns import utcnow
from services.db.errors import NotFoundError
from services.db.ids import CheckpointRowId, HubPushId, TenantId
from services.db.models import HubPushRow, HubPushStatus, HubTarget
from services.db.statements import DEFAULT_PAGE_SIZE, execute_count, paginate

_FINISHED: tuple[HubPushStatus, ...] = ("done", "failed")
# Which states each state may be entered from; anything else is a stale or duplicate update.
_ALLOWED_FROM: dict[HubPushStatus, tuple[HubPushStatus, ...]] = {
    "queued": (),
    "running": ("queued",),
    "done": ("queued", "running"),
    "failed": ("queued", "running"),
}


def create_hub_push(
    db: Session,
    tenant_id: TenantId,
    tinker_path: str,
    *,
    target: HubTarget,
    repo: str,
    private: bool = True,
    now: datetime | None = None,
) -> HubPushRow:
    """Queue an export of the tenant's checkpoint at `tinker_path`; `NotFoundError` if it is not theirs."""
    checkpoint = get_checkpoint(db, tenant_id, tinker_path)
    if checkpoint is None:
        raise NotFoundError(f"checkpoint {tinker_path} not found")
    row = HubPushRow(
        tenant_id=tenant_id,
        checkpoint_id=CheckpointRowId(checkpoint.id),
        tinker_path=tinker_path,
        target=target,
        repo=repo,
        private=private,
        status="queued",
        created_at=now or utcnow(),
    )
    db.add(row)
    db.flush()
    return row


def get_hub_push(db: Session, tenant_id: TenantId, push_id: HubPushId) -> HubPushRow | None:
    stmt = select(HubPushRow).where(HubPushRow.id == push_id, HubPushRow.tenant_id == tenant_id)
    return db.scalars(stmt).one_or_none()


def list_hub_pushes(
    db: Session, tenant_id: TenantId, *, limit: int = DEFAULT_PAGE_SIZE, offset: int = 0
) -> list[HubPushRow]:
    """The tenant's pushes, newest first."""
    stmt = select(HubPushRow).where(HubPushRow.tenant_id == tenant_id)
    stmt = stmt.order_by(HubPushRow.created_at.desc(), HubPushRow.id.desc())
    return list(db.scalars(paginate(stmt, limit, offset)))


def set_hub_push_status(
    db: Session,
    tenant_id: TenantId,
    push_id: HubPushId,
    status: HubPushStatus,
    *,
    error: str | None = None,
    now: datetime | None = None,
) -> bool:
    """Move a push to `status` if that is a legal transition from its current one; False otherwise."""
    values: dict[str, object] = {"status": status, "error": error}
    if status in _FINISHED:
        values["finished_at"] = now or utcnow()
    stmt = update(HubPushRow).where(
        HubPushRow.id == push_id,
        HubPushRow.tenant_id == tenant_id,
        HubPushRow.status.in_(_ALLOWED_FROM[status]),
    )
    return execute_count(db, stmt.values(**values)) == 1
