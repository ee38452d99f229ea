"""The dashboard's read models: cross-tenant listings, each paged on the server, as plain frozen rows.

Every function takes a `Page` (limit + offset, bounded) and returns at most `limit` rows plus whether more
exist, so no page ever loads a whole table; aggregates (today's usage, live keys, steps) are computed only
for the rows on the page. Deliberately cross-tenant: only the admin dashboard calls these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Any, Generic, TypeVar

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from services.db.models import (
    ApiKeyRow,
    CheckpointRow,
    HubPushRow,
    RequestRow,
    TenantRow,
    TrainingRunRow,
    UsageRow,
)
from services.db.statements import MAX_PAGE_SIZE

TRAINED_KINDS = ("forward_backward",)
SAMPLED_KINDS = ("sample",)
MAX_LOSS_POINTS = 2000
_T = TypeVar("_T")


@dataclass(frozen=True)
class Page:
    """A window of a listing; `limit` is bounded like every repository listing."""

    limit: int = 50
    offset: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.limit <= MAX_PAGE_SIZE or self.offset < 0:
            raise ValueError(f"page limit must be in [1, {MAX_PAGE_SIZE}] and offset >= 0")


@dataclass(frozen=True)
class Paged(Generic[_T]):
    rows: list[_T]
    page: Page
    more: bool


def _paged(db: Session, stmt: Select[Any], page: Page) -> tuple[list[Any], bool]:
    """Fetch one row beyond the page to know whether another page exists (no COUNT over the table)."""
    rows = list(db.execute(stmt.limit(page.limit + 1).offset(page.offset)).all())
    return rows[: page.limit], len(rows) > page.limit


# -- tenants and keys -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TenantLine:
    id: str
    name: str
    is_admin: bool
    disabled: bool
    created_at: datetime
    live_keys: int
    tokens_trained_today: int
    tokens_sampled_today: int
    requests_today: int
    max_models: int | None
    tokens_per_minute: int | None
    max_concurrent_requests: int | None


def tenants(db: Session, page: Page, *, today: datetime, name_prefix: str | None = None) -> Paged[TenantLine]:
    stmt = select(TenantRow).order_by(TenantRow.name)
    if name_prefix:
        stmt = stmt.where(TenantRow.name.startswith(name_prefix, autoescape=True))
    rows, more = _paged(db, stmt, page)
    ids = [r.id for (r,) in rows]
    keys = dict(db.execute(select(ApiKeyRow.tenant_id, func.count()).where(
        ApiKeyRow.tenant_id.in_(ids), ApiKeyRow.revoked_at.is_(None)).group_by(ApiKeyRow.tenant_id)).all())
    usage: dict[tuple[str, str], tuple[int, int]] = {
        (t, k): (int(tokens or 0), int(reqs or 0)) for t, k, tokens, reqs in db.execute(
            select(UsageRow.tenant_id, UsageRow.kind, func.sum(UsageRow.tokens), func.sum(UsageRow.requests))
            .where(UsageRow.tenant_id.in_(ids), UsageRow.bucket_start >= today)
            .group_by(UsageRow.tenant_id, UsageRow.kind)).all()}

    def tokens(tenant: str, kinds: Sequence[str]) -> int:
        return sum(usage.get((tenant, k), (0, 0))[0] for k in kinds)

    lines = [TenantLine(r.id, r.name, r.is_admin, r.disabled, r.created_at, int(keys.get(r.id, 0)),
                        tokens(r.id, TRAINED_KINDS), tokens(r.id, SAMPLED_KINDS),
                        sum(n for (t, _), (_, n) in usage.items() if t == r.id),
                        r.max_models, r.tokens_per_minute, r.max_concurrent_requests) for (r,) in rows]
    return Paged(lines, page, more)


@dataclass(frozen=True)
class KeyLine:
    id: int
    prefix: str
    label: str | None
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


def tenant_keys(db: Session, tenant_id: str, page: Page) -> Paged[KeyLine]:
    """The tenant's keys by prefix (never more than the prefix), live ones first, newest first."""
    stmt = (select(ApiKeyRow).where(ApiKeyRow.tenant_id == tenant_id)
            .order_by(ApiKeyRow.revoked_at.is_not(None), ApiKeyRow.created_at.desc(), ApiKeyRow.id.desc()))
    rows, more = _paged(db, stmt, page)
    return Paged([KeyLine(k.id, k.prefix, k.label, k.created_at, k.last_used_at, k.revoked_at) for (k,) in rows],
                 page, more)


# -- training runs ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunLine:
    id: str
    tenant_id: str
    tenant_name: str
    base_model: str
    lora_rank: int
    status: str
    steps: int
    created_at: datetime
    last_activity: datetime


def runs(db: Session, page: Page, *, tenant_id: str | None = None) -> Paged[RunLine]:
    stmt = (select(TrainingRunRow, TenantRow.name).join(TenantRow, TenantRow.id == TrainingRunRow.tenant_id)
            .order_by(TrainingRunRow.created_at.desc(), TrainingRunRow.id.desc()))
    if tenant_id:
        stmt = stmt.where(TrainingRunRow.tenant_id == tenant_id)
    rows, more = _paged(db, stmt, page)
    steps = _steps(db, [r.id for r, _ in rows])
    lines = [RunLine(r.id, r.tenant_id, name, r.base_model, r.lora_rank, r.status, steps.get(r.id, 0),
                     r.created_at, r.last_request_at or r.created_at) for r, name in rows]
    return Paged(lines, page, more)


def _steps(db: Session, run_ids: list[str]) -> dict[str, int]:
    if not run_ids:
        return {}
    stmt = (select(RequestRow.model_id, func.count()).where(
        RequestRow.model_id.in_(run_ids), RequestRow.kind == "optim_step", RequestRow.status == "done")
        .group_by(RequestRow.model_id))
    return {str(m): int(n) for m, n in db.execute(stmt).all()}


@dataclass(frozen=True)
class RunDetail:
    run: RunLine
    losses: list[tuple[int, float]]
    """(seq id, loss:sum) of the run's forward/backward passes, in order."""
    checkpoints: list[CheckpointLine]


def run_detail(db: Session, run_id: str) -> RunDetail | None:
    found = db.execute(select(TrainingRunRow, TenantRow.name).join(
        TenantRow, TenantRow.id == TrainingRunRow.tenant_id).where(TrainingRunRow.id == run_id)).one_or_none()
    if found is None:
        return None
    r, name = found
    line = RunLine(r.id, r.tenant_id, name, r.base_model, r.lora_rank, r.status, _steps(db, [r.id]).get(r.id, 0),
                   r.created_at, r.last_request_at or r.created_at)
    losses = db.execute(select(RequestRow.seq_id, RequestRow.loss).where(
        RequestRow.model_id == run_id, RequestRow.loss.is_not(None)).order_by(RequestRow.seq_id)
        .limit(MAX_LOSS_POINTS)).all()
    return RunDetail(line, [(int(s or 0), float(v)) for s, v in losses],
                     checkpoints(db, Page(100), run_id=run_id).rows)


# -- requests ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestLine:
    id: str
    tenant_name: str
    model_id: str | None
    kind: str
    status: str
    created_at: datetime
    wait_s: float | None
    run_s: float | None
    num_tokens: int | None
    error: str | None
    category: str | None
    pass_id: str | None


@dataclass(frozen=True)
class RequestFilter:
    tenant_id: str | None = None
    model_id: str | None = None
    kind: str | None = None
    status: str | None = None


def requests(db: Session, page: Page, where: RequestFilter) -> Paged[RequestLine]:
    stmt = (select(RequestRow, TenantRow.name).join(TenantRow, TenantRow.id == RequestRow.tenant_id)
            .order_by(RequestRow.created_at.desc(), RequestRow.id.desc()))
    for column, value in ((RequestRow.tenant_id, where.tenant_id), (RequestRow.model_id, where.model_id),
                          (RequestRow.kind, where.kind), (RequestRow.status, where.status)):
        if value:
            stmt = stmt.where(column == value)
    rows, more = _paged(db, stmt, page)
    return Paged([_request_line(r, name) for r, name in rows], page, more)


def _request_line(r: RequestRow, tenant_name: str) -> RequestLine:
    wait = (r.started_at - r.created_at).total_seconds() if r.started_at else None
    ran = (r.finished_at - r.started_at).total_seconds() if r.finished_at and r.started_at else None
    return RequestLine(r.id, tenant_name, r.model_id, r.kind, r.status, r.created_at, wait, ran, r.num_tokens,
                       r.error, r.category, r.pass_id)


# -- checkpoints and hub pushes ---------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointLine:
    tinker_path: str
    tenant_name: str
    kind: str
    size_bytes: int | None
    created_at: datetime
    expires_at: datetime | None
    public: bool


def checkpoints(db: Session, page: Page, *, tenant_id: str | None = None,
                run_id: str | None = None) -> Paged[CheckpointLine]:
    stmt = (select(CheckpointRow, TenantRow.name).join(TenantRow, TenantRow.id == CheckpointRow.tenant_id)
            .order_by(CheckpointRow.created_at.desc(), CheckpointRow.id.desc()))
    if tenant_id:
        stmt = stmt.where(CheckpointRow.tenant_id == tenant_id)
    if run_id:
        stmt = stmt.where(CheckpointRow.training_run_id == run_id)
    rows, more = _paged(db, stmt, page)
    return Paged([CheckpointLine(c.tinker_path, name, c.kind, c.size_bytes, c.created_at, c.expires_at, c.public)
                  for c, name in rows], page, more)


@dataclass(frozen=True)
class PushLine:
    id: int
    tenant_name: str
    tinker_path: str
    target: str
    repo: str
    status: str
    error: str | None
    created_at: datetime


def hub_pushes(db: Session, page: Page, *, tenant_id: str | None = None) -> Paged[PushLine]:
    stmt = (select(HubPushRow, TenantRow.name).join(TenantRow, TenantRow.id == HubPushRow.tenant_id)
            .order_by(HubPushRow.id.desc()))
    if tenant_id:
        stmt = stmt.where(HubPushRow.tenant_id == tenant_id)
    rows, more = _paged(db, stmt, page)
    return Paged([PushLine(p.id, name, p.tinker_path, p.target, p.repo, p.status, p.error, p.created_at)
                  for p, name in rows], page, more)


# -- usage ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class UsageLine:
    day: date
    tenant_id: str
    tenant_name: str
    kind: str
    tokens: int
    requests: int


def usage_by_day(db: Session, page: Page, *, since: datetime, tenant_id: str | None = None) -> Paged[UsageLine]:
    """Per tenant, day and kind since `since`; the page is a page of *tenants* (by name), so each page sums
    only its tenants' hourly buckets (through the usage primary key) instead of the whole table."""
    tenant_stmt = select(TenantRow.id, TenantRow.name).order_by(TenantRow.name, TenantRow.id)
    if tenant_id:
        tenant_stmt = tenant_stmt.where(TenantRow.id == tenant_id)
    tenant_rows, more = _paged(db, tenant_stmt, page)
    names = {str(t): str(n) for t, n in tenant_rows}
    day = _day(db, UsageRow.bucket_start)
    stmt = (select(day, UsageRow.tenant_id, UsageRow.kind, func.sum(UsageRow.tokens), func.sum(UsageRow.requests))
            .where(UsageRow.tenant_id.in_(list(names)), UsageRow.bucket_start >= since)
            .group_by(day, UsageRow.tenant_id, UsageRow.kind))
    lines = [UsageLine(_as_date(d), str(t), names[str(t)], k, int(tok or 0), int(req or 0))
             for d, t, k, tok, req in db.execute(stmt).all()]
    lines.sort(key=lambda u: (u.tenant_name, -u.day.toordinal(), u.kind))
    return Paged(lines, page, more)


def stored_bytes(db: Session, tenant_ids: Sequence[str]) -> dict[str, int]:
    """Checkpoint bytes each tenant stores now (what `/v1/usage` reports as `checkpoint_bytes`)."""
    stmt = (select(CheckpointRow.tenant_id, func.coalesce(func.sum(CheckpointRow.size_bytes), 0))
            .where(CheckpointRow.tenant_id.in_(list(tenant_ids))).group_by(CheckpointRow.tenant_id))
    return {str(t): int(n) for t, n in db.execute(stmt).all()}


def _day(db: Session, column: Any) -> Any:
    if db.get_bind().dialect.name == "postgresql":
        return func.date_trunc("day", column)
    return func.date(column)


def _as_date(value: object) -> date:
    if isinstance(value, datetime):
        return value.date()
    if isinstance(value, date):
        return value
    return date.fromisoformat(str(value)[:10])


def day_start(now: datetime) -> datetime:
    """Midnight UTC of `now`'s day (what "today" means on the dashboard)."""
    return now.replace(hour=0, minute=0, second=0, microsecond=0)


def days_ago(now: datetime, days: int) -> datetime:
    return day_start(now) - timedelta(days=days)


# -- scheduler and packing --------------------------------------------------------------------------
PASS_KINDS = ("forward", "forward_backward")


@dataclass(frozen=True)
class PassLine:
    pass_id: str
    started_at: datetime | None
    tenants: list[str]
    adapters: int
    requests: int
    tokens: int
    wall_s: float | None


def recent_passes(db: Session, *, limit: int, scan: int = 2000) -> list[PassLine]:
    """The latest packed passes, rebuilt from the request log (each request names the pass that ran it)."""
    stmt = (select(RequestRow.pass_id, TenantRow.name, RequestRow.model_id, RequestRow.num_tokens,
                   RequestRow.started_at, RequestRow.finished_at)
            .join(TenantRow, TenantRow.id == RequestRow.tenant_id)
            .where(RequestRow.pass_id.is_not(None), RequestRow.kind.in_(PASS_KINDS))
            .order_by(RequestRow.created_at.desc()).limit(scan))
    grouped: dict[str, list[Any]] = {}
    for row in db.execute(stmt).all():
        grouped.setdefault(str(row[0]), []).append(row)
    lines = []
    for pass_id, rows in list(grouped.items())[:limit]:
        starts = [r[4] for r in rows if r[4] is not None]
        ends = [r[5] for r in rows if r[5] is not None]
        wall = (max(ends) - min(starts)).total_seconds() if starts and ends else None
        lines.append(PassLine(pass_id, min(starts) if starts else None, sorted({r[1] for r in rows}),
                              len({r[2] for r in rows}), len(rows), sum(r[3] or 0 for r in rows), wall))
    return lines


@dataclass(frozen=True)
class TenantStanding:
    """A tenant's recent share of the scheduler and what its queue waits were."""

    tenant_name: str
    requests: int
    tokens: int
    share: float
    """Of all pass tokens in the window."""
    fair_share: float
    """1 / tenants active in the window: what an even split would give."""
    mean_wait_s: float | None
    max_wait_s: float | None


def standings(db: Session, *, since: datetime, scan: int = 20_000) -> list[TenantStanding]:
    stmt = (select(TenantRow.name, RequestRow.num_tokens, RequestRow.created_at, RequestRow.started_at)
            .join(TenantRow, TenantRow.id == RequestRow.tenant_id)
            .where(RequestRow.created_at >= since, RequestRow.kind.in_(PASS_KINDS))
            .order_by(RequestRow.created_at.desc()).limit(scan))
    per: dict[str, list[tuple[int, float | None]]] = {}
    for name, tokens, created, started in db.execute(stmt).all():
        wait = (started - created).total_seconds() if started is not None else None
        per.setdefault(name, []).append((int(tokens or 0), wait))
    total = sum(t for rows in per.values() for t, _ in rows) or 1
    fair = 1.0 / len(per) if per else 0.0
    out = []
    for name, rows in sorted(per.items()):
        waits = [w for _, w in rows if w is not None]
        tokens = sum(t for t, _ in rows)
        out.append(TenantStanding(name, len(rows), tokens, tokens / total, fair,
                                  sum(waits) / len(waits) if waits else None, max(waits) if waits else None))
    return out
