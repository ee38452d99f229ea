"""Repository for the rest of the tinker SDK surface: batched completions, joined sampling clients, stability
records, stored custom losses, projects and session search.

Every read is scoped to the caller's tenant like the other repositories (another tenant's row is None).
Completions of a sampling session are read in finishing order with a microsecond watermark: one scheduler
loop per base model marks its requests finished one transaction after another, so a session's finish times
become visible in increasing order and a watermark never skips a completion.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Integer, bindparam, func, or_, select, update
from sqlalchemy.orm import Session

from services.db.ids import RequestId, SamplingSessionId, SessionId, TenantId
from services.db.models import (
    CheckpointRow,
    CustomLossRow,
    RequestRow,
    SamplingSessionRow,
    SessionRow,
    TrainingRunRow,
)
from services.db.statements import core

CLONE_STRIDE = 1_000_000_000
"""A cloned sampling client numbers its requests `clone * 10**9 + n` (the SDK's convention)."""
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def to_cursor(ts: datetime) -> int:
    """A finish time as the opaque integer cursor of `retrieve_futures` (microseconds since the epoch)."""
    aware = ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)
    return (aware - _EPOCH) // timedelta(microseconds=1)


def from_cursor(cursor: int) -> datetime:
    return _EPOCH + timedelta(microseconds=cursor)


@dataclass(frozen=True)
class Completion:
    request_id: RequestId
    failed: bool
    cursor: int


def _clone_bounds(clone: int) -> dict[str, int]:
    lo = clone * CLONE_STRIDE
    return {"seq_lo": lo, "seq_hi": lo + CLONE_STRIDE}


def _in_clone(stmt: Any) -> Any:
    return stmt.where(RequestRow.seq_id >= bindparam("seq_lo"), RequestRow.seq_id < bindparam("seq_hi"))


# A held `retrieve_futures` poll reads both of these in every look, three looks or so per sample: built once
# with bind parameters and run on the session's connection (`core`). Built per call and run through the ORM,
# a look cost 0.83 ms of CPU on SQLite against 6 us for its two queries in sqlite3 (session 18).
_COMPLETIONS_AFTER = _in_clone(
    select(RequestRow.id, RequestRow.status, RequestRow.finished_at).where(
        RequestRow.sampling_session_id == bindparam("sampling_id"),
        RequestRow.status.in_(("done", "failed")),
        RequestRow.finished_at > bindparam("after"),
    )).order_by(RequestRow.finished_at).limit(bindparam("limit", type_=Integer()))
# finished_at is NULL exactly while a request is unfinished: the (session, finished_at) index then reads the
# unfinished rows alone, not every request the session ever made.
_UNFINISHED = _in_clone(
    select(RequestRow.id).where(
        RequestRow.sampling_session_id == bindparam("sampling_id"),
        RequestRow.finished_at.is_(None),
        RequestRow.status.in_(("queued", "running")),
    )).order_by(RequestRow.created_at).limit(bindparam("limit", type_=Integer()))


def completions_after(db: Session, sampling_id: SamplingSessionId, clone: int, cursor: int,
                      limit: int) -> list[Completion]:
    """Requests of one (sampling session, clone) that finished after `cursor`, in finishing order."""
    params = {"sampling_id": sampling_id, "after": from_cursor(cursor), "limit": limit, **_clone_bounds(clone)}
    return [Completion(RequestId(rid), status == "failed", to_cursor(ts))
            for rid, status, ts in core(db).execute(_COMPLETIONS_AFTER, params)]


def unfinished_requests(db: Session, sampling_id: SamplingSessionId, clone: int, limit: int) -> list[RequestId]:
    """The oldest requests of one (sampling session, clone) still queued or running."""
    params = {"sampling_id": sampling_id, "limit": limit, **_clone_bounds(clone)}
    return [RequestId(rid) for (rid,) in core(db).execute(_UNFINISHED, params)]


def unfinished_and_completions(db: Session, sampling_id: SamplingSessionId, clone: int, cursor: int,
                               unfinished_limit: int, limit: int, *,
                               completions_first: bool = False) -> tuple[list[RequestId], list[Completion]]:
    """`unfinished_requests`, then `completions_after`, in one transaction: what a held batched poll looks at.
    In this order because under PostgreSQL's READ COMMITTED each statement reads its own snapshot: a request
    that finishes between the two is then in both lists (and reported), never in neither (and missed).
    `completions_first` (a look that expects a completion) reads the completions alone first and stops there
    when there are any (no unfinished requests are read then)."""
    if completions_first:
        found = completions_after(db, sampling_id, clone, cursor, limit)
        if found:
            return [], found
    return (unfinished_requests(db, sampling_id, clone, unfinished_limit),
            completions_after(db, sampling_id, clone, cursor, limit))


def join_sampling_session(db: Session, tenant_id: TenantId, sampling_id: SamplingSessionId) -> int | None:
    """Allocate the next client id of a sampling session (the original client is 0); None if not found."""
    stmt = (update(SamplingSessionRow)
            .where(SamplingSessionRow.id == sampling_id, SamplingSessionRow.tenant_id == tenant_id)
            .values(joined_clients=SamplingSessionRow.joined_clients + 1)
            .returning(SamplingSessionRow.joined_clients))
    return db.execute(stmt).scalar_one_or_none()


def mark_stability_recorded(db: Session, request_id: RequestId) -> None:
    db.execute(update(RequestRow).where(RequestRow.id == request_id).values(record_stability=True))


def recorded_samples(db: Session, tenant_id: TenantId, request_ids: list[RequestId]) -> dict[RequestId, RequestRow]:
    """The tenant's sample requests among `request_ids` that recorded stability info."""
    stmt = select(RequestRow).where(RequestRow.id.in_(request_ids), RequestRow.tenant_id == tenant_id,
                                    RequestRow.kind == "sample", RequestRow.record_stability.is_(True))
    return {RequestId(r.id): r for r in db.scalars(stmt)}


# -- custom losses ------------------------------------------------------------------------------------------
def store_custom_loss(db: Session, tenant_id: TenantId, session_id: SessionId, seq: int, loss_id: str,
                      name: str, program: dict[str, Any], now: datetime) -> CustomLossRow:
    """Store a loss, or return the one this (session, seq) already stored (a retried request)."""
    existing = db.scalars(select(CustomLossRow).where(CustomLossRow.session_id == session_id,
                                                      CustomLossRow.seq == seq)).one_or_none()
    if existing is not None:
        return existing
    row = CustomLossRow(id=loss_id, tenant_id=tenant_id, session_id=session_id, seq=seq, name=name,
                        program=program, created_at=now)
    db.add(row)
    db.flush()
    return row


def count_custom_losses(db: Session, session_id: SessionId) -> int:
    return int(db.scalar(select(func.count()).where(CustomLossRow.session_id == session_id)) or 0)


def get_custom_loss(db: Session, tenant_id: TenantId, loss_id: str) -> CustomLossRow | None:
    stmt = select(CustomLossRow).where(CustomLossRow.id == loss_id, CustomLossRow.tenant_id == tenant_id)
    return db.scalars(stmt).one_or_none()


# -- projects and search ------------------------------------------------------------------------------------
def assign_project(db: Session, tenant_id: TenantId, session_id: SessionId, project_id: str | None) -> bool:
    stmt = (update(SessionRow).where(SessionRow.id == session_id, SessionRow.tenant_id == tenant_id)
            .values(project_id=project_id))
    return (db.execute(stmt).rowcount or 0) > 0  # type: ignore[attr-defined]


@dataclass(frozen=True)
class SessionQuery:
    session_id: str | None = None
    display_name: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] | None = None
    statuses: list[str] | None = None
    """`active` (not finished) and/or `client_finished`; None: every session."""
    before: tuple[datetime, str] | None = None
    """(created_at, id) of the last session of the previous page."""
    limit: int = 50
    unassigned_project: str | None = None
    """The project id that also matches sessions without a project."""


def search_sessions(db: Session, tenant_id: TenantId, query: SessionQuery) -> list[SessionRow]:
    """The tenant's sessions matching `query`, newest first (user_metadata is matched in Python: JSON
    containment differs between SQLite and PostgreSQL, and a page is at most a few hundred rows)."""
    stmt = select(SessionRow).where(SessionRow.tenant_id == tenant_id)
    ids_or_names = []
    if query.session_id is not None:
        ids_or_names.append(SessionRow.id == query.session_id)
    if query.display_name is not None:
        ids_or_names.append(_all_words([w for w in query.display_name.lower().split() if w] or [""]))
    if ids_or_names:
        stmt = stmt.where(or_(*ids_or_names))
    if query.project_ids is not None:
        in_project = SessionRow.project_id.in_(query.project_ids)
        if query.unassigned_project in query.project_ids:
            in_project = or_(in_project, SessionRow.project_id.is_(None))
        stmt = stmt.where(in_project)
    if query.statuses is not None:
        finished = [SessionRow.finished_at.is_(None)] if "active" in query.statuses else []
        if "client_finished" in query.statuses:
            finished.append(SessionRow.finished_at.is_not(None))
        stmt = stmt.where(or_(*finished)) if finished else stmt.where(SessionRow.id.is_(None))
    if query.before is not None:
        created, sid = query.before
        stmt = stmt.where(or_(SessionRow.created_at < created,
                              (SessionRow.created_at == created) & (SessionRow.id < sid)))
    stmt = stmt.order_by(SessionRow.created_at.desc(), SessionRow.id.desc())
    wanted = query.user_metadata or {}
    rows: list[SessionRow] = []
    for row in db.scalars(stmt.limit(query.limit * 4 if wanted else query.limit)):
        meta = {str(k): str(v) for k, v in (row.user_metadata or {}).items()}
        if all(meta.get(k) == v for k, v in wanted.items()):
            rows.append(row)
        if len(rows) == query.limit:
            break
    return rows


def _all_words(words: list[str]) -> Any:
    name = func.lower(func.coalesce(SessionRow.display_name, ""))
    clause = name.contains(words[0])
    for word in words[1:]:
        clause = clause & name.contains(word)
    return clause


def project_runs(db: Session, tenant_id: TenantId, project_id: str, unassigned_project: str, limit: int,
                 offset: int) -> tuple[list[TrainingRunRow], int]:
    """The tenant's runs whose session is in `project_id` (`unassigned_project` also matches none set), newest
    first, and how many there are."""
    in_project = SessionRow.project_id == project_id
    if project_id == unassigned_project:
        in_project = or_(in_project, SessionRow.project_id.is_(None))
    where = (TrainingRunRow.tenant_id == tenant_id, in_project)
    base = select(TrainingRunRow).join(SessionRow, SessionRow.id == TrainingRunRow.session_id).where(*where)
    rows = db.scalars(base.order_by(TrainingRunRow.created_at.desc(), TrainingRunRow.id.desc())
                      .limit(limit).offset(offset))
    total = db.scalar(select(func.count()).select_from(TrainingRunRow)
                      .join(SessionRow, SessionRow.id == TrainingRunRow.session_id).where(*where))
    return list(rows), int(total or 0)


def session_checkpoints(db: Session, session_ids: list[str]) -> dict[str, tuple[int, int]]:
    """(checkpoint count, stored bytes) per session, through its training runs."""
    stmt = (select(TrainingRunRow.session_id, func.count(CheckpointRow.id),
                   func.coalesce(func.sum(CheckpointRow.size_bytes), 0))
            .join(CheckpointRow, CheckpointRow.training_run_id == TrainingRunRow.id)
            .where(TrainingRunRow.session_id.in_(session_ids)).group_by(TrainingRunRow.session_id))
    return {sid: (int(n), int(size)) for sid, n, size in db.execute(stmt)}


def session_requests(db: Session, tenant_id: TenantId, session_id: SessionId, limit: int) -> list[RequestRow]:
    """A session's requests (its runs' and samplers'), oldest first: what its trace shows."""
    runs = select(TrainingRunRow.id).where(TrainingRunRow.session_id == session_id)
    samplers = select(SamplingSessionRow.id).where(SamplingSessionRow.session_id == session_id)
    stmt = (select(RequestRow).where(RequestRow.tenant_id == tenant_id,
                                     or_(RequestRow.model_id.in_(runs), RequestRow.sampling_session_id.in_(samplers)))
            .order_by(RequestRow.created_at).limit(limit))
    return list(db.scalars(stmt))
