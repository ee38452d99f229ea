"""Repository for per-tenant usage: token and request counts aggregated into hourly buckets.

One row per (tenant, hour, kind) is upserted on each increment, so the table grows with time rather than
with traffic, and per-tenant reports are a range scan on the primary key. Kinds are free-form strings
such as `train_tokens` or `sample_tokens`; their meaning belongs to the caller.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from services.db.columns import utcnow
from services.db.ids import TenantId
from services.db.models import UsageRow
from services.db.prepared import PreparedStatement
from services.db.statements import insert_for_dialect

_USAGE_KEYS = ("tenant_id", "bucket_start", "kind", "tokens", "requests")


@dataclass(frozen=True)
class UsageTotal:
    """Sums over a time range for one usage kind."""

    kind: str
    tokens: int
    requests: int


def hour_bucket(ts: datetime) -> datetime:
    """The start of the UTC hour containing `ts`."""
    return ts.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def record_usage(
    db: Session,
    tenant_id: TenantId,
    kind: str,
    *,
    tokens: int,
    requests: int = 1,
    now: datetime | None = None,
) -> None:
    """Add `tokens` and `requests` to the tenant's bucket for the current hour (created on first use)."""
    if tokens < 0 or requests < 0:
        raise ValueError(f"usage increments must be >= 0, got tokens={tokens} requests={requests}")
    params = {"tenant_id": tenant_id, "bucket_start": hour_bucket(now or utcnow()), "kind": kind,
              "tokens": tokens, "requests": requests}
    _upsert(db.get_bind().dialect.name).execute(db, params)


def record_usage_many(db: Session, increments: Mapping[tuple[TenantId, str], tuple[int, int]], *,
                      now: datetime | None = None) -> None:
    """`record_usage` for many (tenant, kind) pairs at once: `increments` maps each to (tokens, requests),
    already summed (one upsert per bucket: a statement may not touch a row twice), run as one executemany."""
    bucket = hour_bucket(now or utcnow())
    rows = []
    for (tenant_id, kind), (tokens, requests) in increments.items():
        if tokens < 0 or requests < 0:
            raise ValueError(f"usage increments must be >= 0, got tokens={tokens} requests={requests}")
        rows.append({"tenant_id": tenant_id, "bucket_start": bucket, "kind": kind, "tokens": tokens,
                     "requests": requests})
    _upsert(db.get_bind().dialect.name).executemany(db, rows)


@functools.cache
def _upsert(dialect: str) -> PreparedStatement:
    """The increment, built once per backend."""
    insert = insert_for_dialect(dialect, UsageRow)
    # A single upsert is atomic on both backends: concurrent increments to one bucket never lose counts.
    upsert = insert.on_conflict_do_update(
        index_elements=[UsageRow.tenant_id, UsageRow.bucket_start, UsageRow.kind],
        set_={
            "tokens": UsageRow.tokens + insert.excluded.tokens,
            "requests": UsageRow.requests + insert.excluded.requests,
        },
    )
    return PreparedStatement(upsert, column_keys=_USAGE_KEYS)


def usage_buckets(
    db: Session,
    tenant_id: TenantId,
    *,
    since: datetime,
    until: datetime | None = None,
    kind: str | None = None,
) -> list[UsageRow]:
    """The tenant's hourly buckets starting in [hour of `since`, `until`), oldest first."""
    stmt = select(UsageRow).where(
        UsageRow.tenant_id == tenant_id, UsageRow.bucket_start >= hour_bucket(since)
    )
    if until is not None:
        stmt = stmt.where(UsageRow.bucket_start < until)
    if kind is not None:
        stmt = stmt.where(UsageRow.kind == kind)
    return list(db.scalars(stmt.order_by(UsageRow.bucket_start, UsageRow.kind)))


def usage_totals(
    db: Session, tenant_id: TenantId, *, since: datetime, until: datetime | None = None
) -> dict[str, UsageTotal]:
    """Per-kind sums of the tenant's buckets starting in [hour of `since`, `until`)."""
    stmt = select(UsageRow.kind, func.sum(UsageRow.tokens), func.sum(UsageRow.requests)).where(
        UsageRow.tenant_id == tenant_id, UsageRow.bucket_start >= hour_bucket(since)
    )
    if until is not None:
        stmt = stmt.where(UsageRow.bucket_start < until)
    rows = db.execute(stmt.group_by(UsageRow.kind)).all()
    return {kind: UsageTotal(kind, int(tokens or 0), int(reqs or 0)) for kind, tokens, reqs in rows}
