"""Audited operator actions: each change to a tenant, its keys or its quotas (or an operator's retry of a
failed hub push) writes an audit entry with it.

The CLI (`deploy.admin`) and the admin dashboard (`gateway.admin`) both call these, so "who changed what"
is recorded the same way whichever door the operator used. Each function takes the caller's session and
flushes; the caller commits, so the change and its audit entry land together or not at all.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.auth.tenants import IssuedKey, Tenant, create_tenant_with_key, issue_api_key
from services.db.audit import record_audit
from services.db.ids import ApiKeyId, TenantId
from services.db.models import ApiKeyRow, HubPushRow, TenantRow
from services.db.tenants import (
    TenantQuotas,
    revoke_api_key,
    revoke_api_keys_by_prefix,
    set_tenant_disabled,
    set_tenant_quotas,
    tenant_quotas,
)


@dataclass(frozen=True)
class Actor:
    """Who acts: an admin tenant and the prefix of its key, or the CLI (both None: database access)."""

    tenant_id: str | None = None
    key_prefix: str | None = None


CLI_ACTOR = Actor()


def _audit(session: Session, actor: Actor, action: str, target_type: str, target_id: str,
           tenant_id: str | None, detail: dict[str, object] | None = None) -> None:
    record_audit(session, action=action, target_type=target_type, target_id=target_id,
                 actor_tenant_id=actor.tenant_id, actor_key_prefix=actor.key_prefix,
                 tenant_id=tenant_id, detail=detail)


def create_tenant(session: Session, actor: Actor, name: str, *, is_admin: bool = False,
                  quotas: TenantQuotas | None = None) -> tuple[Tenant, IssuedKey]:
    """A tenant and its first key (`ConflictError` if the name is taken)."""
    tenant, issued = create_tenant_with_key(session, name, is_admin=is_admin, quotas=quotas)
    _audit(session, actor, "tenant.create", "tenant", tenant.id, tenant.id,
           {"name": name, "is_admin": is_admin, "key_prefix": issued.prefix})
    return tenant, issued


def set_disabled(session: Session, actor: Actor, tenant_id: TenantId, disabled: bool) -> bool:
    """Disable or re-enable a tenant; False if it does not exist."""
    if not set_tenant_disabled(session, tenant_id, disabled):
        return False
    _audit(session, actor, "tenant.disable" if disabled else "tenant.enable", "tenant", tenant_id, tenant_id)
    return True


def set_quotas(session: Session, actor: Actor, row: TenantRow, quotas: TenantQuotas) -> None:
    """Replace the tenant's quotas, recording the old and new values."""
    before = asdict(tenant_quotas(row))
    set_tenant_quotas(session, TenantId(row.id), quotas)
    session.refresh(row)
    _audit(session, actor, "quota.change", "tenant", row.id, row.id, {"before": before, "after": asdict(quotas)})


def create_key(session: Session, actor: Actor, tenant_id: TenantId, *, label: str | None) -> IssuedKey:
    """Another key for the tenant (`NotFoundError` if unknown); the audit entry holds its prefix only."""
    issued = issue_api_key(session, tenant_id, label=label)
    _audit(session, actor, "key.create", "api_key", str(issued.key_id), tenant_id, {"prefix": issued.prefix})
    return issued


def revoke_key(session: Session, actor: Actor, tenant_id: TenantId, key_id: ApiKeyId) -> bool:
    """Revoke one live key of the tenant; False if it is not the tenant's or already revoked."""
    prefix = session.scalar(select(ApiKeyRow.prefix).where(ApiKeyRow.id == key_id,
                                                            ApiKeyRow.tenant_id == tenant_id))
    if not revoke_api_key(session, tenant_id, key_id):
        return False
    _audit(session, actor, "key.revoke", "api_key", str(key_id), tenant_id, {"prefix": prefix})
    return True


def revoke_keys_by_prefix(session: Session, actor: Actor, prefix: str) -> list[tuple[str, int]]:
    """Revoke every live key with this display prefix, whoever owns it; returns the revoked keys as
    (tenant id, key id) pairs, so each can be announced to the gateways' auth caches."""
    live = session.execute(
        select(ApiKeyRow.tenant_id, ApiKeyRow.id).where(ApiKeyRow.prefix == prefix, ApiKeyRow.revoked_at.is_(None))
    ).all()
    revoked: list[tuple[str, int]] = []
    for owner in sorted({tenant_id for tenant_id, _ in live}):
        count = revoke_api_keys_by_prefix(session, TenantId(owner), prefix)
        if count:
            _audit(session, actor, "key.revoke", "api_key", prefix, owner, {"prefix": prefix, "count": count})
            revoked += [(tenant_id, key_id) for tenant_id, key_id in live if tenant_id == owner]
    return sorted(revoked)


def record_hub_push_retry(session: Session, actor: Actor, push: HubPushRow) -> None:
    """The audit entry of an operator's retry of a failed push (written in the transaction that requeues it)."""
    _audit(session, actor, "hub_push.retry", "hub_push", str(push.id), push.tenant_id,
           {"tinker_path": push.tinker_path, "repo": push.repo, "attempts": push.attempts})
