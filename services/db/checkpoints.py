"""Repository for checkpoints: saved adapter weights addressed by their `tinker://` path.

Rows hold metadata and the `storage_uri` of the bytes; deleting a row returns it so that the caller can
delete the bytes too. A tenant sees its own checkpoints, plus other tenants' public, unexpired ones
through `get_readable_checkpoint` only (what loading weights from a shared path needs).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.orm import Session

from services.db.columns import utcnow
from services.db.errors import ConflictError, NotFoundError
from services.db.ids import ModelId, TenantId
from services.db.models import CheckpointKind, CheckpointRow
from services.db.runs import get_training_run
from services.db.statements import DEFAULT_PAGE_SIZE, execute_count, paginate


def create_checkpoint(
    db: Session,
    tenant_id: TenantId,
    training_run_id: ModelId,
    checkpoint_id: str,
    *,
    kind: CheckpointKind,
    tinker_path: str,
    storage_uri: str,
    size_bytes: int | None = None,
    expires_at: datetime | None = None,
    user_metadata: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> CheckpointRow:
    """Record a saved checkpoint of one of the tenant's runs.

    Raises `NotFoundError` if the run is not this tenant's, `ConflictError` if the name is taken in the run.
    """
    if get_training_run(db, tenant_id, training_run_id) is None:
        raise NotFoundError(f"training run {training_run_id} not found")
    existing = select(CheckpointRow.id).where(
        CheckpointRow.training_run_id == training_run_id, CheckpointRow.checkpoint_id == checkpoint_id
    )
    if db.scalar(existing) is not None:
        raise ConflictError(f"checkpoint {checkpoint_id!r} already exists in {training_run_id}")
    row = CheckpointRow(
        tenant_id=tenant_id,
        training_run_id=training_run_id,
        checkpoint_id=checkpoint_id,
        kind=kind,
        tinker_path=tinker_path,
        storage_uri=storage_uri,
        size_bytes=size_bytes,
        public=False,
        expires_at=expires_at,
        user_metadata=dict(user_metadata or {}),
        created_at=now or utcnow(),
    )
    db.add(row)
    db.flush()
    return row


def get_checkpoint(db: Session, tenant_id: TenantId, tinker_path: str) -> CheckpointRow | None:
    """The tenant's own checkpoint at `tinker_path` (expired or not), else None."""
    stmt = select(CheckpointRow).where(
        CheckpointRow.tinker_path == tinker_path, CheckpointRow.tenant_id == tenant_id
    )
    return db.scalars(stmt).one_or_none()


def get_readable_checkpoint(
    db: Session, tenant_id: TenantId, tinker_path: str, *, now: datetime | None = None
) -> CheckpointRow | None:
    """A checkpoint the tenant may load: its own, or another tenant's public one; never an expired one."""
    now = now or utcnow()
    stmt = select(CheckpointRow).where(
        CheckpointRow.tinker_path == tinker_path,
        or_(CheckpointRow.tenant_id == tenant_id, CheckpointRow.public.is_(True)),
        or_(CheckpointRow.expires_at.is_(None), CheckpointRow.expires_at > now),
    )
    return db.scalars(stmt).one_or_none()


def list_checkpoints_for_run(
    db: Session,
    tenant_id: TenantId,
    training_run_id: ModelId,
    *,
    limit: int = DEFAULT_PAGE_SIZE,
    offset: int = 0,
) -> list[CheckpointRow]:
    """One run's checkpoints, oldest first (the order Tinker's `list_checkpoints` shows them in)."""
    stmt = select(CheckpointRow).where(
        CheckpointRow.tenant_id == tenant_id, CheckpointRow.training_run_id == training_run_id
    )
    stmt = stmt.order_by(CheckpointRow.created_at, CheckpointRow.id)
    return list(db.scalars(paginate(stmt, limit, offset)))


def list_checkpoints(
    db: Session,
    tenant_id: TenantId,
    *,
    kind: CheckpointKind | None = None,
    limit: int = DEFAULT_PAGE_SIZE,
    offset: int = 0,
) -> list[CheckpointRow]:
    """All the tenant's checkpoints across runs, newest first."""
    stmt = select(CheckpointRow).where(CheckpointRow.tenant_id == tenant_id)
    if kind is not None:
        stmt = stmt.where(CheckpointRow.kind == kind)
    stmt = stmt.order_by(CheckpointRow.created_at.desc(), CheckpointRow.id.desc())
    return list(db.scalars(paginate(stmt, limit, offset)))


def latest_checkpoint(
    db: Session, tenant_id: TenantId, training_run_id: ModelId, kind: CheckpointKind
) -> CheckpointRow | None:
    """The run's most recent checkpoint of `kind` (Tinker's `last_checkpoint`/`last_sampler_checkpoint`)."""
    stmt = (
        select(CheckpointRow)
        .where(
            CheckpointRow.tenant_id == tenant_id,
            CheckpointRow.training_run_id == training_run_id,
            CheckpointRow.kind == kind,
        )
        .order_by(CheckpointRow.created_at.desc(), CheckpointRow.id.desc())
        .limit(1)
    )
    return db.scalars(stmt).first()


def _update_own(db: Session, tenant_id: TenantId, tinker_path: str, **values: Any) -> bool:
    stmt = update(CheckpointRow).where(
        CheckpointRow.tinker_path == tinker_path, CheckpointRow.tenant_id == tenant_id
    )
    return execute_count(db, stmt.values(**values)) == 1


def set_checkpoint_public(db: Session, tenant_id: TenantId, tinker_path: str, public: bool) -> bool:
    """Publish or unpublish one of the tenant's checkpoints. False if it is not the tenant's."""
    return _update_own(db, tenant_id, tinker_path, public=public)


def set_checkpoint_expiry(
    db: Session, tenant_id: TenantId, tinker_path: str, expires_at: datetime | None
) -> bool:
    """Set (or clear, with None) when the checkpoint expires. False if it is not the tenant's."""
    return _update_own(db, tenant_id, tinker_path, expires_at=expires_at)


def delete_checkpoint(db: Session, tenant_id: TenantId, tinker_path: str) -> CheckpointRow | None:
    """Delete the tenant's checkpoint row and return it (its `storage_uri` is the caller's to delete)."""
    row = get_checkpoint(db, tenant_id, tinker_path)
    if row is None:
        return None
    db.execute(delete(CheckpointRow).where(CheckpointRow.id == row.id))
    return row


def find_expired_checkpoints(
    db: Session, *, now: datetime | None = None, limit: int = DEFAULT_PAGE_SIZE
) -> list[CheckpointRow]:
    """Checkpoints of any tenant whose TTL has passed. Cross-tenant by design: for the expiry sweeper."""
    stmt = (
        select(CheckpointRow)
        .where(CheckpointRow.expires_at.is_not(None), CheckpointRow.expires_at <= (now or utcnow()))
        .order_by(CheckpointRow.expires_at, CheckpointRow.id)
    )
    return list(db.scalars(paginate(stmt, limit, 0)))


def checkpoint_storage_bytes(db: Session, tenant_id: TenantId) -> int:
    """Total recorded size of the tenant's checkpoints (rows with an unknown size count as 0)."""
    stmt = select(func.coalesce(func.sum(CheckpointRow.size_bytes), 0)).where(
        CheckpointRow.tenant_id == tenant_id
    )
    return int(db.scalar(stmt) or 0)
