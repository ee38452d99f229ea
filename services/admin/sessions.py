"""Dashboard logins: opaque, server-side, revocable sessions bound to the admin API key that opened them.

The cookie carries a random token; the table holds only its SHA-256, with the CSRF token of the session,
its expiry and the key it came from. A session is valid only while it is unexpired and not logged out, its
key is live and its tenant is an enabled admin: revoking the key (or disabling the tenant, or taking its
admin role) ends every session it opened at the next request, with nothing to wait for.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from services.db.columns import utcnow
from services.db.ids import ApiKeyId, TenantId
from services.db.models import AdminSessionRow, ApiKeyRow, TenantRow

TOKEN_BYTES = 32


@dataclass(frozen=True)
class AdminSession:
    """A live dashboard session: who (tenant, key prefix) and the CSRF token its forms must carry."""

    tenant_id: TenantId
    tenant_name: str
    api_key_id: ApiKeyId
    key_prefix: str
    csrf_token: str
    expires_at: datetime


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def open_session(db: Session, *, tenant_id: TenantId, api_key_id: ApiKeyId, ttl: timedelta,
                 now: datetime | None = None) -> str:
    """Store a new session; returns the cookie token (the only copy: the table keeps its hash)."""
    now = now or utcnow()
    token = secrets.token_urlsafe(TOKEN_BYTES)
    db.add(AdminSessionRow(id=_digest(token), api_key_id=api_key_id, tenant_id=tenant_id,
                           csrf_token=secrets.token_urlsafe(TOKEN_BYTES), created_at=now, expires_at=now + ttl))
    db.flush()
    return token


def resolve_session(db: Session, token: str, *, now: datetime | None = None) -> AdminSession | None:
    """The session of `token` if it is still valid (see the module docstring), else None."""
    now = now or utcnow()
    stmt = (
        select(AdminSessionRow, ApiKeyRow.prefix, TenantRow.name)
        .join(ApiKeyRow, ApiKeyRow.id == AdminSessionRow.api_key_id)
        .join(TenantRow, TenantRow.id == AdminSessionRow.tenant_id)
        .where(AdminSessionRow.id == _digest(token), AdminSessionRow.revoked_at.is_(None),
               AdminSessionRow.expires_at > now, ApiKeyRow.revoked_at.is_(None),
               ApiKeyRow.tenant_id == AdminSessionRow.tenant_id,
               TenantRow.is_admin.is_(True), TenantRow.disabled.is_(False))
    )
    found = db.execute(stmt).one_or_none()
    if found is None:
        return None
    row, prefix, name = found
    return AdminSession(TenantId(row.tenant_id), name, ApiKeyId(row.api_key_id), prefix, row.csrf_token,
                        row.expires_at)


def close_session(db: Session, token: str, *, now: datetime | None = None) -> None:
    """Log out: the session stops resolving at once."""
    stmt = update(AdminSessionRow).where(AdminSessionRow.id == _digest(token), AdminSessionRow.revoked_at.is_(None))
    db.execute(stmt.values(revoked_at=now or utcnow()))


def purge_expired(db: Session, *, now: datetime | None = None) -> int:
    """Delete sessions past their expiry (run at each login: the table stays as small as the live set)."""
    result = db.execute(delete(AdminSessionRow).where(AdminSessionRow.expires_at <= (now or utcnow())))
    return int(getattr(result, "rowcount", 0) or 0)
