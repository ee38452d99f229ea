"""Who is calling: turning an API key into an authenticated `Tenant`, and issuing keys to tenants.

`authenticate` is the only way the gateway learns a caller's tenant id; every repository call after it
is scoped by that id. Unknown, malformed and revoked keys and disabled tenants all look the same to the
caller (None), so a probe cannot tell which of them it hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from services.auth.keys import generate_api_key, hash_api_key, hashes_equal, key_prefix, looks_like_api_key
from services.db.columns import utcnow
from services.db.ids import ApiKeyId, TenantId
from services.db.models import TenantRow
from services.db.tenants import (
    TenantQuotas,
    add_api_key,
    create_tenant,
    find_api_key_with_tenant,
    find_live_keys_with_tenants,
    tenant_quotas,
    touch_api_key,
    touch_api_keys,
)


@dataclass(frozen=True)
class Tenant:
    """An authenticated caller: detached from the database, safe to keep for the request's lifetime."""

    id: TenantId
    name: str
    is_admin: bool
    quotas: TenantQuotas
    api_key_id: ApiKeyId | None = None
    """The key the caller authenticated with (None when built from a row directly, e.g. by the CLI)."""

    @classmethod
    def from_row(cls, row: TenantRow, api_key_id: ApiKeyId | None = None) -> Tenant:
        return cls(TenantId(row.id), row.name, row.is_admin, tenant_quotas(row), api_key_id)


@dataclass(frozen=True)
class IssuedKey:
    """A freshly issued key. `key` is the only copy of the secret: show it once, never log or store it."""

    key: str
    key_id: ApiKeyId
    prefix: str

    def __repr__(self) -> str:  # keep the secret out of tracebacks and debug logs
        return f"IssuedKey(key_id={self.key_id}, prefix={self.prefix!r})"


def issue_api_key(
    db: Session, tenant_id: TenantId, *, label: str | None = None, pepper: bytes | None = None
) -> IssuedKey:
    """Generate a key for the tenant and store its hash. Raises `NotFoundError` for an unknown tenant."""
    key = generate_api_key()
    row = add_api_key(db, tenant_id, key_hash=hash_api_key(key, pepper), prefix=key_prefix(key), label=label)
    return IssuedKey(key=key, key_id=ApiKeyId(row.id), prefix=row.prefix)


def create_tenant_with_key(
    db: Session,
    name: str,
    *,
    is_admin: bool = False,
    quotas: TenantQuotas | None = None,
    pepper: bytes | None = None,
) -> tuple[Tenant, IssuedKey]:
    """Create a tenant and its first key in the caller's transaction; `ConflictError` if the name is taken."""
    row = create_tenant(db, name, is_admin=is_admin, quotas=quotas)
    issued = issue_api_key(db, TenantId(row.id), label="initial", pepper=pepper)
    return Tenant.from_row(row, issued.key_id), issued


TOUCH_INTERVAL_S = 60.0
"""A key's `last_used_at` is refreshed at most this often."""


def _use_is_stale(last_used_at: datetime | None, now: datetime) -> bool:
    """Whether the key's recorded use is old enough to refresh. The row was just read, so a fresh one costs
    no statement at all: the UPDATE (whose WHERE re-checks the age, for concurrent gateways) is a write,
    which on SQLite takes the database's one write lock, and with hundreds of tenants re-authenticating
    every cache interval it was the largest database cost of the gateway (py-spy, bench/load.py N = 128)."""
    return last_used_at is None or now - last_used_at >= timedelta(seconds=TOUCH_INTERVAL_S)


def authenticate(
    db: Session,
    key: str,
    *,
    pepper: bytes | None = None,
    now: datetime | None = None,
    record_use: bool = True,
) -> Tenant | None:
    """The tenant owning `key`, or None if the key is malformed, unknown or revoked, or the tenant disabled.

    With `record_use`, the key's `last_used_at` is refreshed (at most once a minute), which is a write:
    commit the session afterwards.
    """
    if not looks_like_api_key(key):
        return None
    digest = hash_api_key(key, pepper)
    found = find_api_key_with_tenant(db, digest)
    if found is None:
        return None
    key_row, tenant_row = found
    # The lookup is by exact hash already; the constant-time check is defence in depth against an index
    # or collation that matches more loosely than byte equality.
    if not hashes_equal(key_row.key_hash, digest) or key_row.revoked_at is not None or tenant_row.disabled:
        return None
    if record_use and _use_is_stale(key_row.last_used_at, now := now or utcnow()):
        touch_api_key(db, ApiKeyId(key_row.id), now=now, min_interval_s=TOUCH_INTERVAL_S)
    return Tenant.from_row(tenant_row, ApiKeyId(key_row.id))


def revalidate(db: Session, key_ids: Sequence[ApiKeyId], *, now: datetime | None = None) -> dict[ApiKeyId, Tenant]:
    """The tenants behind those of `key_ids` that still work (not revoked, tenant not disabled), re-read, and
    their uses recorded like `authenticate`'s (a write when one is stale: commit afterwards). A key missing
    from the answer no longer authenticates anyone."""
    now = now or utcnow()
    live = find_live_keys_with_tenants(db, key_ids)
    stale = [key_id for key_id, last_used, _ in live if _use_is_stale(last_used, now)]
    if stale:
        touch_api_keys(db, stale, now=now, min_interval_s=TOUCH_INTERVAL_S)
    return {key_id: Tenant.from_row(row, key_id) for key_id, _, row in live}
