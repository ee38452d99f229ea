"""Repository for hub pushes (exports of a tenant's checkpoint to Hugging Face or ModelScope) and hub tokens.

A push row is created when the tenant asks for the export and moves queued → running → done|failed as
the push task works on it (running → running again when a retry claims it). Only the owner of a checkpoint
can push it. `claim_hub_push`/`finish_hub_push` are the task's view, by push id across tenants (the task
was handed the id by the tenant's own request). Hub credentials are stored as ciphertext only.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from services.db.checkpoints import get_checkpoint
from services.db.columns import utcnow
from services.db.errors import NotFoundError
from services.db.ids import CheckpointRowId, HubPushId, TenantId
from services.db.models import HubCredentialRow, HubPushRow, HubPushStatus, HubTarget
from services.db.statements import DEFAULT_PAGE_SIZE, execute_count, paginate

_FINISHED: tuple[HubPushStatus, ...] = ("done", "failed")
# Which states each state may be entered from; anything else is a stale or duplicate update.
_ALLOWED_FROM: dict[HubPushStatus, tuple[HubPushStatus, ...]] = {
    "queued": (),
    "running": ("queued", "running"),  # running again: a retry (or a redelivery after a crash)
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
    revision: str | None = None,
    commit_message: str | None = None,
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
        revision=revision,
        commit_message=commit_message,
        attempts=0,
        status="queued",
        created_at=now or utcnow(),
    )
    db.add(row)
    db.flush()
    return row


def get_hub_push(db: Session, tenant_id: TenantId, push_id: HubPushId) -> HubPushRow | None:
    stmt = select(HubPushRow).where(HubPushRow.id == push_id, HubPushRow.tenant_id == tenant_id)
    return db.scalars(stmt).one_or_none()


def count_hub_pushes(db: Session, tenant_id: TenantId) -> int:
    stmt = select(func.count()).select_from(HubPushRow).where(HubPushRow.tenant_id == tenant_id)
    return int(db.scalar(stmt) or 0)


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


# -- the push task's view (by id) ------------------------------------------------------------------
def claim_hub_push(db: Session, push_id: HubPushId, *, now: datetime | None = None) -> HubPushRow | None:
    """Mark an unfinished push running and count the attempt; None if it is finished (or unknown)."""
    row = db.get(HubPushRow, push_id, with_for_update=True)
    if row is None or row.status in _FINISHED:
        return None
    row.status, row.attempts, row.error = "running", row.attempts + 1, None
    row.started_at = row.started_at or now or utcnow()
    db.flush()
    return row


def finish_hub_push(db: Session, push_id: HubPushId, status: HubPushStatus, *, error: str | None = None,
                    hub_revision: str | None = None, url: str | None = None,
                    now: datetime | None = None) -> bool:
    """done or failed, with the hub's answer or the error; False if the push had already finished."""
    assert status in _FINISHED
    stmt = update(HubPushRow).where(HubPushRow.id == push_id, HubPushRow.status.in_(_ALLOWED_FROM[status]))
    values = {"status": status, "error": error, "hub_revision": hub_revision, "url": url,
              "finished_at": now or utcnow()}
    return execute_count(db, stmt.values(**values)) == 1


def requeue_failed_hub_push(
    db: Session, push_id: HubPushId, *, tenant_id: TenantId | None = None
) -> tuple[HubPushRow, HubPushStatus] | None:
    """Put a failed push back in the queue (error and finish time cleared; `attempts` keeps counting).

    Returns the row and the status it had: only a `failed` one is requeued, any other comes back
    unchanged. None if there is no such push (of `tenant_id`, when given; None: any tenant's, for operators).
    The row is locked, so two concurrent retries requeue it once.
    """
    stmt = select(HubPushRow).where(HubPushRow.id == push_id).with_for_update()
    if tenant_id is not None:
        stmt = stmt.where(HubPushRow.tenant_id == tenant_id)
    row = db.scalars(stmt).one_or_none()
    if row is None:
        return None
    before: HubPushStatus = row.status
    if before == "failed":
        row.status, row.error, row.finished_at = "queued", None, None
        db.flush()
    return row, before


def unfinished_hub_push_ids(db: Session) -> list[HubPushId]:
    """Pushes queued or running (a restarted in-process executor picks them up again), oldest first."""
    stmt = select(HubPushRow.id).where(HubPushRow.status.in_(("queued", "running"))).order_by(HubPushRow.id)
    return [HubPushId(i) for i in db.scalars(stmt)]


# -- credentials -------------------------------------------------------------------------------------
def put_hub_credential(db: Session, tenant_id: TenantId, target: HubTarget, ciphertext: str, *,
                       now: datetime | None = None) -> None:
    """Store (or replace) the tenant's encrypted token for `target`."""
    now = now or utcnow()
    stmt = select(HubCredentialRow).where(HubCredentialRow.tenant_id == tenant_id,
                                          HubCredentialRow.target == target).with_for_update()
    row = db.scalars(stmt).one_or_none()
    if row is None:
        db.add(HubCredentialRow(tenant_id=tenant_id, target=target, token_ciphertext=ciphertext,
                                created_at=now, updated_at=now))
    else:
        row.token_ciphertext, row.updated_at = ciphertext, now
    db.flush()


def get_hub_credential(db: Session, tenant_id: TenantId, target: HubTarget) -> str | None:
    """The tenant's encrypted token for `target`, if it stored one."""
    stmt = select(HubCredentialRow.token_ciphertext).where(HubCredentialRow.tenant_id == tenant_id,
                                                           HubCredentialRow.target == target)
    return db.scalars(stmt).one_or_none()


def delete_hub_credential(db: Session, tenant_id: TenantId, target: HubTarget) -> bool:
    stmt = delete(HubCredentialRow).where(HubCredentialRow.tenant_id == tenant_id,
                                          HubCredentialRow.target == target)
    return execute_count(db, stmt) == 1
