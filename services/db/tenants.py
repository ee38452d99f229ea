"""Repository for tenants and their API keys (stored as hashes; hashing itself lives in services.auth).

Tenant functions are admin operations keyed by the tenant id itself. API key lookups by hash are the one
deliberately unscoped read: they are how a request's tenant is determined in the first place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from services.db.columns import utcnow
from services.db.errors import ConflictError, NotFoundError
from services.db.ids import ApiKeyId, TenantId, new_tenant_id
from services.db.models import ApiKeyRow, TenantRow
from services.db.statements import DEFAULT_PAGE_SIZE, execute_count, paginate


@dataclass(frozen=True)
class TenantQuotas:
    """Per-tenant limits; None means "no tenant-specific limit" (the server-wide default applies)."""

    max_models: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    max_checkpoints: int | None = None
    """Stored checkpoints (every kind)."""
    max_checkpoint_bytes: int | None = None
    """Recorded size of all stored checkpoints."""
    max_sessions: int | None = None
    """Unfinished sessions."""
    max_sampling_sessions: int | None = None
    """Sampling sessions of unfinished sessions."""


def create_tenant(
    db: Session,
    name: str,
    *,
    is_admin: bool = False,
    quotas: TenantQuotas | None = None,
    tenant_id: TenantId | None = None,
) -> TenantRow:
    """Add a tenant; raises `ConflictError` if the name is taken."""
    if get_tenant_by_name(db, name) is not None:
        raise ConflictError(f"tenant {name!r} already exists")
    quotas = quotas or TenantQuotas()
    row = TenantRow(
        id=tenant_id or new_tenant_id(),
        name=name,
        is_admin=is_admin,
        disabled=False,
        created_at=utcnow(),
        max_models=quotas.max_models,
        tokens_per_minute=quotas.tokens_per_minute,
        max_concurrent_requests=quotas.max_concurrent_requests,
        max_checkpoints=quotas.max_checkpoints,
        max_checkpoint_bytes=quotas.max_checkpoint_bytes,
        max_sessions=quotas.max_sessions,
        max_sampling_sessions=quotas.max_sampling_sessions,
    )
    db.add(row)
    db.flush()
    return row


def get_tenant(db: Session, tenant_id: TenantId) -> TenantRow | None:
    return db.get(TenantRow, tenant_id)


def get_tenant_by_name(db: Session, name: str) -> TenantRow | None:
    return db.scalars(select(TenantRow).where(TenantRow.name == name)).one_or_none()


def list_tenants(db: Session, *, limit: int = DEFAULT_PAGE_SIZE, offset: int = 0) -> list[TenantRow]:
    stmt = select(TenantRow).order_by(TenantRow.created_at, TenantRow.id)
    return list(db.scalars(paginate(stmt, limit, offset)))


def set_tenant_disabled(db: Session, tenant_id: TenantId, disabled: bool) -> bool:
    """Disable (or re-enable) a tenant: a disabled tenant's keys stop authenticating. False if unknown."""
    return (
        execute_count(db, update(TenantRow).where(TenantRow.id == tenant_id).values(disabled=disabled)) == 1
    )


def set_tenant_quotas(db: Session, tenant_id: TenantId, quotas: TenantQuotas) -> bool:
    """Replace all quotas at once. False if the tenant does not exist."""
    values = {field.name: getattr(quotas, field.name) for field in dataclasses.fields(TenantQuotas)}
    return execute_count(db, update(TenantRow).where(TenantRow.id == tenant_id).values(**values)) == 1


_QUOTA_FIELDS = tuple(field.name for field in dataclasses.fields(TenantQuotas))
"""Read once: the gateway's key re-check builds a `Tenant` per key in use (hundreds every few seconds)."""


def tenant_quotas(row: TenantRow) -> TenantQuotas:
    return TenantQuotas(**{name: getattr(row, name) for name in _QUOTA_FIELDS})


def add_api_key(
    db: Session, tenant_id: TenantId, *, key_hash: str, prefix: str, label: str | None = None
) -> ApiKeyRow:
    """Store a key's hash (never the key). Raises `NotFoundError` for an unknown tenant."""
    if get_tenant(db, tenant_id) is None:
        raise NotFoundError(f"tenant {tenant_id} not found")
    row = ApiKeyRow(tenant_id=tenant_id, key_hash=key_hash, prefix=prefix, label=label, created_at=utcnow())
    db.add(row)
    db.flush()
    return row


def find_api_key_by_hash(db: Session, key_hash: str) -> ApiKeyRow | None:
    """The key row with this hash, revoked or not (the caller decides what a revoked key means)."""
    return db.scalars(select(ApiKeyRow).where(ApiKeyRow.key_hash == key_hash)).one_or_none()


def find_api_key_with_tenant(db: Session, key_hash: str) -> tuple[ApiKeyRow, TenantRow] | None:
    """The key row with this hash (revoked or not) and its tenant's row, in one statement: every request of
    a tenant whose gateway cache entry expired looks both up (at 512 tenants, most requests), and a second
    round trip through the ORM was a third of that lookup's cost."""
    row = db.execute(select(ApiKeyRow, TenantRow).join(TenantRow, TenantRow.id == ApiKeyRow.tenant_id)
                     .where(ApiKeyRow.key_hash == key_hash)).one_or_none()
    return None if row is None else (row[0], row[1])


def list_api_keys(db: Session, tenant_id: TenantId, *, include_revoked: bool = False) -> list[ApiKeyRow]:
    stmt = select(ApiKeyRow).where(ApiKeyRow.tenant_id == tenant_id)
    if not include_revoked:
        stmt = stmt.where(ApiKeyRow.revoked_at.is_(None))
    return list(db.scalars(stmt.order_by(ApiKeyRow.created_at, ApiKeyRow.id)))


def revoke_api_key(
    db: Session, tenant_id: TenantId, key_id: ApiKeyId, *, now: datetime | None = None
) -> bool:
    """Revoke one of the tenant's keys. False if it is not the tenant's or was already revoked."""
    stmt = update(ApiKeyRow).where(
        ApiKeyRow.id == key_id, ApiKeyRow.tenant_id == tenant_id, ApiKeyRow.revoked_at.is_(None)
    )
    return execute_count(db, stmt.values(revoked_at=now or utcnow())) == 1


def revoke_api_keys_by_prefix(
    db: Session, tenant_id: TenantId, prefix: str, *, now: datetime | None = None
) -> int:
    """Revoke the tenant's live keys whose displayed prefix is `prefix`; returns how many were revoked."""
    stmt = update(ApiKeyRow).where(
        ApiKeyRow.prefix == prefix, ApiKeyRow.tenant_id == tenant_id, ApiKeyRow.revoked_at.is_(None)
    )
    return execute_count(db, stmt.values(revoked_at=now or utcnow()))


KEY_BATCH = 500
"""Key ids per `IN (...)` list: far below SQLite's and PostgreSQL's bound-parameter limits."""


def touch_api_key(db: Session, key_id: ApiKeyId, *, now: datetime, min_interval_s: float = 60.0) -> None:
    """Record a use of the key, at most once per `min_interval_s` (so auth is not a write per request)."""
    touch_api_keys(db, [key_id], now=now, min_interval_s=min_interval_s)


def touch_api_keys(db: Session, key_ids: Sequence[ApiKeyId], *, now: datetime, min_interval_s: float = 60.0) -> None:
    """`touch_api_key` for many keys in one statement per `KEY_BATCH` keys."""
    cutoff = now - timedelta(seconds=min_interval_s)
    for start in range(0, len(key_ids), KEY_BATCH):
        stmt = update(ApiKeyRow).where(
            ApiKeyRow.id.in_(key_ids[start:start + KEY_BATCH]),
            or_(ApiKeyRow.last_used_at.is_(None), ApiKeyRow.last_used_at < cutoff),
        )
        db.execute(stmt.values(last_used_at=now))


def find_live_keys_with_tenants(
    db: Session, key_ids: Sequence[ApiKeyId]
) -> list[tuple[ApiKeyId, datetime | None, TenantRow]]:
    """Of `key_ids`, those not revoked whose tenant is not disabled: (key id, its `last_used_at`, the tenant's
    row). How a gateway re-checks every key it holds in its cache with one statement per `KEY_BATCH` keys
    instead of one lookup per key and cache interval."""
    out: list[tuple[ApiKeyId, datetime | None, TenantRow]] = []
    for start in range(0, len(key_ids), KEY_BATCH):
        stmt = (select(ApiKeyRow.id, ApiKeyRow.last_used_at, TenantRow)
                .join(TenantRow, TenantRow.id == ApiKeyRow.tenant_id)
                .where(ApiKeyRow.id.in_(key_ids[start:start + KEY_BATCH]), ApiKeyRow.revoked_at.is_(None),
                       TenantRow.disabled.is_(False)))
        out.extend((ApiKeyId(key_id), last_used, tenant) for key_id, last_used, tenant in db.execute(stmt))
    return out
