"""Operator actions on a Carpool database: migrations, tenants and API keys, and the first-start admin.

The bodies of `carpool migrate`, `carpool tenants ...` and `carpool keys ...` (the typer wrappers live in
`deploy.commands`), plus `bootstrap_admin`, which `carpool serve` runs on every start. Keys are returned
to the caller to print once; nothing here logs a key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from typing import TextIO

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from deploy.settings import ServiceSettings
from services.admin import actions
from services.admin.actions import CLI_ACTOR
from services.auth.invalidation import Invalidation
from services.auth.tenants import IssuedKey, Tenant, create_tenant_with_key
from services.db import Database, open_database
from services.db.engine import is_sqlite
from services.db.errors import ConflictError
from services.db.ids import TenantId
from services.db.models import ApiKeyRow, TenantRow
from services.db.schema import head_revision, upgrade_to_head
from services.db.tenants import (
    TenantQuotas,
    get_tenant,
    get_tenant_by_name,
    list_tenants,
    tenant_quotas,
)

ADMIN_TENANT = "admin"


class AdminError(Exception):
    """An operator action that cannot be done as asked; the message says why."""


@dataclass(frozen=True)
class TenantSummary:
    id: str
    name: str
    is_admin: bool
    disabled: bool
    live_keys: int
    max_models: int | None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None


def open_admin_database(settings: ServiceSettings) -> Database:
    """The configured database; a SQLite file is migrated on the spot (single node, nothing to coordinate)."""
    url = settings.resolved_database_url()
    if is_sqlite(url):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    return open_database(url, migrate=is_sqlite(url))


@contextmanager
def admin_transaction(settings: ServiceSettings) -> Iterator[Session]:
    """One transaction on the configured database, which is opened for it and closed after."""
    db = open_admin_database(settings)
    try:
        with db.sessions.begin() as session:
            yield session
    finally:
        db.dispose()


def _named_tenant(session: Session, tenant: str) -> TenantRow:
    """The tenant with this name (or id); an `AdminError` that says how to find one if there is none."""
    row = get_tenant_by_name(session, tenant) or get_tenant(session, TenantId(tenant))
    if row is None:
        raise AdminError(f"no tenant named {tenant!r}; see `carpool tenants list`")
    return row


def migrate(settings: ServiceSettings) -> str:
    """Upgrade the configured database to the newest schema; returns that revision."""
    url = settings.resolved_database_url()
    if is_sqlite(url):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade_to_head(url)
    return head_revision()


def create_tenant(settings: ServiceSettings, name: str, *, is_admin: bool = False,
                  max_models: int | None = None) -> tuple[Tenant, IssuedKey]:
    try:
        with admin_transaction(settings) as session:
            return actions.create_tenant(session, CLI_ACTOR, name, is_admin=is_admin,
                                         quotas=TenantQuotas(max_models=max_models))
    except ConflictError as exc:
        raise AdminError(str(exc)) from exc


def set_quotas(settings: ServiceSettings, tenant: str, **changes: int | None) -> tuple[str, TenantQuotas]:
    """Change some of a tenant's quotas (the fields of `TenantQuotas`: models, tokens per minute, concurrent
    requests, checkpoints and their bytes, sessions, sampling sessions).

    A change of None leaves that quota as it is; 0 removes it (the server-wide default applies again).
    Returns (tenant name, the quotas now in force). Gateways pick them up within their auth cache time.
    """
    unknown = set(changes) - {f.name for f in fields(TenantQuotas)}
    if unknown:
        raise AdminError(f"unknown quota {sorted(unknown)[0]!r}")
    negative = [name for name, value in changes.items() if value is not None and value < 0]
    if negative:
        raise AdminError(f"{negative[0]} must be >= 0 (0 removes the limit)")
    with admin_transaction(settings) as session:
        row = _named_tenant(session, tenant)
        current = asdict(tenant_quotas(row))
        merged = {k: (v if changes.get(k) is None else (changes[k] or None)) for k, v in current.items()}
        quotas = TenantQuotas(**merged)
        actions.set_quotas(session, CLI_ACTOR, row, quotas)
        return row.name, quotas


def set_disabled(settings: ServiceSettings, tenant: str, disabled: bool, *,
                 announce: Callable[[Invalidation], None] | None = None) -> str:
    """Disable (or re-enable) a tenant: its keys stop authenticating at once (on every gateway when
    `announce` reaches them, see `redis_announcer`). Returns the tenant's name."""
    with admin_transaction(settings) as session:
        row = _named_tenant(session, tenant)
        actions.set_disabled(session, CLI_ACTOR, TenantId(row.id), disabled)
        name, tenant_id = row.name, row.id
    if disabled and announce is not None:  # after the commit: a gateway that looks the key up again sees it
        announce(Invalidation(tenant_id))
    return name


def tenant_summaries(settings: ServiceSettings) -> list[TenantSummary]:
    with admin_transaction(settings) as session:
        live = dict(session.execute(
            select(ApiKeyRow.tenant_id, func.count()).where(ApiKeyRow.revoked_at.is_(None))
            .group_by(ApiKeyRow.tenant_id)
        ).all())
        return [_summary(row, int(live.get(row.id, 0))) for row in list_tenants(session, limit=1000)]


def create_key(settings: ServiceSettings, tenant: str) -> tuple[str, IssuedKey]:
    """A new key for the tenant named (or with the id) `tenant`; returns (tenant name, key)."""
    with admin_transaction(settings) as session:
        row = _named_tenant(session, tenant)
        return row.name, actions.create_key(session, CLI_ACTOR, TenantId(row.id), label="cli")


def revoke_keys(settings: ServiceSettings, prefix: str, *,
                announce: Callable[[Invalidation], None] | None = None) -> int:
    """Revoke every live key whose display prefix is `prefix`; returns how many."""
    with admin_transaction(settings) as session:
        revoked = actions.revoke_keys_by_prefix(session, CLI_ACTOR, prefix)
        if not revoked:
            raise AdminError(f"no live key starts with {prefix!r}: give the 12-character prefix of the "
                             "key (e.g. tml-AbCdEfGh)")
    # Key by key: a gateway refuses an invalidated entry from memory for a moment, so announcing the whole
    # tenant would also refuse its other, live keys (401) until that moment passed.
    for owner, key_id in revoked if announce is not None else ():
        announce(Invalidation(owner, key_id))
    return len(revoked)


def redis_announcer(redis_url: str | None, prefix: str) -> Callable[[Invalidation], None] | None:
    """Publishes invalidations to the cluster's gateways (`services.auth.invalidation`); None without Redis."""
    if not redis_url:
        return None

    def announce(invalidation: Invalidation) -> None:
        from services.auth.invalidation import RedisAuthInvalidations
        from services.runtime.redis_replicas import connect

        client = connect(redis_url)
        try:
            RedisAuthInvalidations(client, prefix=prefix).publish(invalidation)
        finally:
            client.close()

    return announce


def bootstrap_admin(db: Database, out: TextIO) -> bool:
    """On a database without an admin tenant, create `admin` and print its key to `out` (once, ever).

    Returns whether it did. The key goes to `out` only, never to a log.
    """
    with db.sessions.begin() as session:
        has_admin = session.scalar(select(func.count()).where(TenantRow.is_admin.is_(True)))
        if has_admin or get_tenant_by_name(session, ADMIN_TENANT) is not None:
            return False
        _, issued = create_tenant_with_key(session, ADMIN_TENANT, is_admin=True)
    out.write("Created the admin tenant. Its API key is shown this once; store it now:\n")
    out.write(issued.key + "\n")
    out.flush()
    return True


def _summary(row: TenantRow, live_keys: int) -> TenantSummary:
    return TenantSummary(row.id, row.name, row.is_admin, row.disabled, live_keys, row.max_models,
                         row.tokens_per_minute, row.max_concurrent_requests)
