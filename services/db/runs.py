"""Repository for training runs (Tinker "models") and sampling sessions, the children of a session.

Both are created with the client-chosen sequence number inside their session, which makes their ids
deterministic (`{session}:train:{n}`, `{session}:sample:{k}`) and their creation idempotent: a retried
create returns the existing row. Every read takes the caller's `tenant_id`; another tenant's row is None.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import Integer, Table, Update, bindparam, case, func, select, update
from sqlalchemy.orm import Session

from services.db.columns import utcnow
from services.db.errors import NotFoundError
from services.db.ids import (
    ModelId,
    SamplingSessionId,
    SessionId,
    TenantId,
    sampling_session_id,
    training_run_id,
)
from services.db.models import SamplingSessionRow, TrainingRunRow, TrainingRunStatus
from services.db.prepared import PreparedStatement
from services.db.sessions import get_session
from services.db.statements import DEFAULT_PAGE_SIZE, execute_count, insert_for, paginate


def _require_session(db: Session, tenant_id: TenantId, session_id: SessionId) -> None:
    if get_session(db, tenant_id, session_id) is None:
        raise NotFoundError(f"session {session_id} not found")


def create_training_run(
    db: Session,
    tenant_id: TenantId,
    session_id: SessionId,
    model_seq_id: int,
    *,
    base_model: str,
    lora_rank: int,
    lora_config: dict[str, Any] | None = None,
    user_metadata: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> TrainingRunRow:
    """Create run `{session_id}:train:{model_seq_id}`, or return it if it exists (a retried request).

    Raises `NotFoundError` if the session is not this tenant's.
    """
    _require_session(db, tenant_id, session_id)
    run_id = training_run_id(session_id, model_seq_id)
    values = {
        "id": run_id,
        "tenant_id": tenant_id,
        "session_id": session_id,
        "base_model": base_model,
        "lora_rank": lora_rank,
        "lora_config": dict(lora_config or {}),
        "user_metadata": dict(user_metadata or {}),
        "created_at": now or utcnow(),
        "next_seq_id": 0,
        "status": "active",
    }
    # ON CONFLICT DO NOTHING keeps concurrent retries from failing the transaction on the primary key.
    db.execute(insert_for(db, TrainingRunRow).values(**values).on_conflict_do_nothing())
    row = get_training_run(db, tenant_id, run_id)
    if row is None:  # unreachable: the session (hence the id's prefix) belongs to this tenant
        raise NotFoundError(f"training run {run_id} not found")
    return row


def get_training_run(db: Session, tenant_id: TenantId, model_id: ModelId) -> TrainingRunRow | None:
    """The run if it exists and belongs to `tenant_id`, else None."""
    return db.scalars(_RUN_BY_ID, {"model_id": model_id, "tenant_id": tenant_id}).one_or_none()


_RUN_BY_ID = select(TrainingRunRow).where(TrainingRunRow.id == bindparam("model_id"),
                                          TrainingRunRow.tenant_id == bindparam("tenant_id"))
"""Built once: a run is looked up on every training request."""


class RunFacts(NamedTuple):
    """What every ordered submission needs of its run: columns that never change after creation."""

    id: ModelId
    session_id: SessionId
    base_model: str


def list_training_runs(
    db: Session,
    tenant_id: TenantId,
    *,
    session_id: SessionId | None = None,
    limit: int = DEFAULT_PAGE_SIZE,
    offset: int = 0,
) -> list[TrainingRunRow]:
    """The tenant's runs (optionally one session's), newest first."""
    stmt = select(TrainingRunRow).where(TrainingRunRow.tenant_id == tenant_id)
    if session_id is not None:
        stmt = stmt.where(TrainingRunRow.session_id == session_id)
    stmt = stmt.order_by(TrainingRunRow.created_at.desc(), TrainingRunRow.id.desc())
    return list(db.scalars(paginate(stmt, limit, offset)))


def count_active_training_runs(db: Session, tenant_id: TenantId) -> int:
    """How many of the tenant's runs hold an adapter slot (what the `max_models` quota limits)."""
    stmt = select(func.count()).where(
        TrainingRunRow.tenant_id == tenant_id, TrainingRunRow.status == "active"
    )
    return int(db.scalar(stmt) or 0)


def set_training_run_status(
    db: Session, tenant_id: TenantId, model_id: ModelId, status: TrainingRunStatus
) -> bool:
    stmt = update(TrainingRunRow).where(TrainingRunRow.id == model_id, TrainingRunRow.tenant_id == tenant_id)
    return execute_count(db, stmt.values(status=status)) == 1


def reserve_seq_id(
    db: Session,
    tenant_id: TenantId,
    model_id: ModelId,
    seq_id: int | None = None,
    *,
    now: datetime | None = None,
) -> int | None:
    """Claim a request sequence number on the run and bump `last_request_at`, atomically.

    With `seq_id` None the next number is assigned; with a client-supplied `seq_id`, `next_seq_id` moves
    past it (never backwards). Returns the claimed number, or None if the run is not this tenant's.
    A single UPDATE ... RETURNING, so concurrent callers never get the same number.
    """
    params = {"w_id": model_id, "w_tenant_id": tenant_id, "v_at": now or utcnow(), "v_seq": seq_id}
    # A run row the caller loaded keeps its old counter (a Core statement on the session's connection).
    stmt = _RESERVE_NEXT if seq_id is None else _RESERVE_GIVEN
    rows = stmt.execute(db, params)
    if not rows:
        return None
    claimed_next = int(rows[0][0])
    return claimed_next - 1 if seq_id is None else seq_id


def _reserve_statement(given: bool) -> Update:
    table: Table = TrainingRunRow.__table__  # type: ignore[assignment]
    column, seq = table.c.next_seq_id, bindparam("v_seq", type_=Integer())
    return (
        update(table)
        .where(table.c.id == bindparam("w_id"), table.c.tenant_id == bindparam("w_tenant_id"))
        .values(next_seq_id=case((column > seq, column), else_=seq + 1) if given else column + 1,
                last_request_at=bindparam("v_at", type_=table.c.last_request_at.type))
        .returning(column)
    )


_RESERVE_NEXT = PreparedStatement(_reserve_statement(given=False))
_RESERVE_GIVEN = PreparedStatement(_reserve_statement(given=True))


def create_sampling_session(
    db: Session,
    tenant_id: TenantId,
    session_id: SessionId,
    sampling_session_seq_id: int,
    *,
    base_model: str,
    model_path: str | None = None,
    now: datetime | None = None,
) -> SamplingSessionRow:
    """Create `{session_id}:sample:{k}`, or return it if it exists. `NotFoundError` for a foreign session."""
    _require_session(db, tenant_id, session_id)
    row_id = sampling_session_id(session_id, sampling_session_seq_id)
    values = {
        "id": row_id,
        "tenant_id": tenant_id,
        "session_id": session_id,
        "base_model": base_model,
        "model_path": model_path,
        "created_at": now or utcnow(),
    }
    db.execute(insert_for(db, SamplingSessionRow).values(**values).on_conflict_do_nothing())
    row = get_sampling_session(db, tenant_id, row_id)
    if row is None:  # unreachable: the session (hence the id's prefix) belongs to this tenant
        raise NotFoundError(f"sampling session {row_id} not found")
    return row


def get_sampling_session(
    db: Session, tenant_id: TenantId, sampling_id: SamplingSessionId
) -> SamplingSessionRow | None:
    """The sampling session if it exists and belongs to `tenant_id`, else None."""
    stmt = select(SamplingSessionRow).where(
        SamplingSessionRow.id == sampling_id, SamplingSessionRow.tenant_id == tenant_id
    )
    return db.scalars(stmt).one_or_none()


def list_sampling_sessions(
    db: Session,
    tenant_id: TenantId,
    *,
    session_id: SessionId | None = None,
    limit: int = DEFAULT_PAGE_SIZE,
    offset: int = 0,
) -> list[SamplingSessionRow]:
    """The tenant's sampling sessions (optionally one session's), newest first."""
    stmt = select(SamplingSessionRow).where(SamplingSessionRow.tenant_id == tenant_id)
    if session_id is not None:
        stmt = stmt.where(SamplingSessionRow.session_id == session_id)
    stmt = stmt.order_by(SamplingSessionRow.created_at.desc(), SamplingSessionRow.id.desc())
    return list(db.scalars(paginate(stmt, limit, offset)))
