"""The SDK's `AdminClient`: audit log, billing usage events and current checkpoint storage.

Backed by the tables the dashboard reads — one audit log (`services/db/audit.py`, written by the CLI, the
dashboard and the SDK calls that change sharing: `copy_weights`, project moves) and one usage store (the
hourly `usage` buckets the scheduler loops fill) — so the SDK and the dashboard never disagree. An admin key
sees every tenant; any other key sees its own tenant's entries, usage and storage (the hosted service gates
these calls on organization roles; a Carpool tenant is its own organization).
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any, Literal

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from services.auth.tenants import Tenant
from services.control.api import Invalid
from services.control.context import ControlContext
from services.control.surface_views import AuditView, BillingEventView, StorageUsageView
from services.db.audit import list_audit, record_audit
from services.db.ids import TenantId
from services.db.models import CheckpointRow, SessionRow, TenantRow, TrainingRunRow, UsageRow
from services.db.statements import MAX_PAGE_SIZE

MAX_WINDOW = timedelta(days=14)
MAX_AUDIT_PAGES = 20
"""A day's audit log is read newest first, at most this many pages of `MAX_PAGE_SIZE`."""

# Usage kinds (the scheduler's request kinds) → billing event types.
_BILLED: dict[str, Literal["training", "sampling_sample", "checkpoint"]] = {
    "forward": "training", "forward_backward": "training", "sample": "sampling_sample", "save": "checkpoint",
}
# Audit event types of the SDK → the audit log's target types.
_AUDIT_TYPES: dict[str, tuple[str, ...]] = {
    "checkpoints": ("checkpoint",), "projects": ("project", "session"), "teams": ("api_key", "key"),
    "organizations": ("tenant", "quota"),
}


def audit(db: Session, tenant: Tenant, *, action: str, target_type: str, target_id: str,
          detail: dict[str, Any]) -> None:
    """Record an SDK-driven change in the shared audit log (same transaction as the change)."""
    record_audit(db, action=action, target_type=target_type, target_id=target_id, actor_tenant_id=tenant.id,
                 actor_key_prefix=None, tenant_id=tenant.id, detail=detail)


class BillingOps:
    def __init__(self, ctx: ControlContext) -> None:
        self._ctx = ctx

    async def audit_log(self, tenant: Tenant, event_type: str, day: date | None) -> list[AuditView]:
        if event_type != "all" and event_type not in _AUDIT_TYPES:
            raise Invalid(f"must be one of all, {', '.join(_AUDIT_TYPES)}", field="event_type")
        start = datetime.combine(day or self._ctx.clock().date(), datetime.min.time(), tzinfo=UTC)
        end = start + timedelta(days=1)
        scope = None if tenant.is_admin else tenant.id

        def tx(db: Session) -> list[AuditView]:
            out: list[AuditView] = []
            before: int | None = None
            for _ in range(MAX_AUDIT_PAGES):
                page = list_audit(db, tenant_id=scope, limit=MAX_PAGE_SIZE, before_id=before)
                for entry in page:
                    created = entry.created_at if entry.created_at.tzinfo else entry.created_at.replace(tzinfo=UTC)
                    wanted = event_type == "all" or entry.target_type in _AUDIT_TYPES[event_type]
                    if start <= created < end and wanted:
                        out.append(AuditView(created, f"{entry.target_type}_{entry.action}".replace(".", "_"), {
                            "actor": entry.actor_tenant_id, "actor_key_prefix": entry.actor_key_prefix,
                            "target_type": entry.target_type, "target_id": entry.target_id,
                            "tenant_id": entry.tenant_id, **entry.detail}))
                if len(page) < MAX_PAGE_SIZE or (page and _aware(page[-1].created_at) < start):
                    break
                before = page[-1].id
            return sorted(out, key=lambda a: a.timestamp)

        return await self._ctx.tx(tx)

    async def billing_usage(self, tenant: Tenant, starting_on: datetime,
                            ending_before: datetime) -> list[BillingEventView]:
        start, end = _aware(starting_on), _aware(ending_before)
        if end <= start:
            raise Invalid("must be after starting_on", field="ending_before")
        if end - start > MAX_WINDOW:
            raise Invalid(f"the window may span at most {MAX_WINDOW.days} days", field="ending_before")
        if start > self._ctx.clock():
            raise Invalid("must not be in the future", field="starting_on")

        def tx(db: Session) -> list[BillingEventView]:
            stmt = (select(UsageRow, TenantRow.name).join(TenantRow, TenantRow.id == UsageRow.tenant_id)
                    .where(UsageRow.bucket_start >= start, UsageRow.bucket_start < end,
                           UsageRow.kind.in_(tuple(_BILLED))))
            if not tenant.is_admin:
                stmt = stmt.where(UsageRow.tenant_id == tenant.id)
            events = []
            for row, name in db.execute(stmt.order_by(UsageRow.bucket_start, UsageRow.tokens.desc())):
                kind = _BILLED[row.kind]
                quantity = row.requests if kind == "checkpoint" else row.tokens
                events.append(BillingEventView(_aware(row.bucket_start), kind, int(quantity), user_id=name))
            return events

        return await self._ctx.tx(tx)

    async def checkpoint_storage(self, tenant: Tenant, project_id: str | None) -> list[StorageUsageView]:
        def tx(db: Session) -> list[StorageUsageView]:
            stmt = (select(SessionRow.project_id, TenantRow.name, func.count(CheckpointRow.id),
                           func.coalesce(func.sum(CheckpointRow.size_bytes), 0))
                    .join(TrainingRunRow, TrainingRunRow.id == CheckpointRow.training_run_id)
                    .join(SessionRow, SessionRow.id == TrainingRunRow.session_id)
                    .join(TenantRow, TenantRow.id == CheckpointRow.tenant_id)
                    .group_by(SessionRow.project_id, TenantRow.name))
            if not tenant.is_admin:
                stmt = stmt.where(CheckpointRow.tenant_id == TenantId(tenant.id))
            if project_id is not None:
                stmt = stmt.where(SessionRow.project_id == project_id)
            return [StorageUsageView(project, owner, int(n), int(size)) for project, owner, n, size in db.execute(stmt)]

        return await self._ctx.tx(tx)


def _aware(ts: datetime) -> datetime:
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)
