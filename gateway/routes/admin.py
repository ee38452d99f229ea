"""The SDK's `AdminClient`: `GET audit`, `GET billing/usage/events`, `GET billing/usage/checkpoints/current`.

An admin key sees every tenant; another key its own tenant's (services/control/billing.py). Dates are UTC;
billing windows are hour-aligned, at most 14 days, not in the future (400 naming the parameter otherwise).
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from gateway.deps import Control, CurrentTenant
from gateway.rendering import wire_json
from services.wire.admin import (
    AuditLogEntry,
    AuditLogResponse,
    BillingEventInfo,
    BillingUsageEvent,
    BillingUsageResponse,
    CurrentCheckpointStorageUsageItem,
    CurrentCheckpointStorageUsageResponse,
)
from services.wire.errors import WireError

router = APIRouter(prefix="/api/v1", tags=["admin"])

GIGABYTE = 1_000_000_000
AuditEventType = Literal["all", "checkpoints", "projects", "teams", "organizations"]


@router.get("/audit", response_model=AuditLogResponse)
async def audit_log(tenant: CurrentTenant, control: Control, event_type: AuditEventType = "all",
                    day: date | None = None) -> JSONResponse:
    """One UTC day's audit entries (default today), oldest first: CLI, dashboard and SDK actions alike."""
    entries = await control.audit_log(tenant, event_type, day)
    return wire_json(AuditLogResponse(entries=[
        AuditLogEntry(timestamp=e.timestamp, event=e.event, event_details=e.details) for e in entries
    ]))


@router.get("/billing/usage/events", response_model=BillingUsageResponse)
async def billing_usage_events(tenant: CurrentTenant, control: Control, starting_on: Annotated[datetime, Query()],
                               ending_before: Annotated[datetime, Query()]) -> JSONResponse:
    """Hourly usage buckets: training tokens, sampled tokens, checkpoints saved."""
    for name, value in (("starting_on", starting_on), ("ending_before", ending_before)):
        if value.minute or value.second or value.microsecond:
            raise WireError(name, "must be aligned to a UTC hour boundary")
    start, end = _utc(starting_on), _utc(ending_before)
    events = await control.billing_usage(tenant, start, end)
    data = []
    for event in events:
        info = (BillingEventInfo(type="checkpoint", count=event.quantity) if event.kind == "checkpoint"
                else BillingEventInfo(type=event.kind, token_count=event.quantity))
        end_of_bucket = event.bucket_start + timedelta(hours=1)
        data.append(BillingUsageEvent(bucket_start=event.bucket_start, bucket_end=end_of_bucket,
                                      base_model=event.base_model, user_id=event.user_id, user_name=event.user_id,
                                      session_id=event.session_id, event_info=info))
    return wire_json(BillingUsageResponse(data=data))


@router.get("/billing/usage/checkpoints/current", response_model=CurrentCheckpointStorageUsageResponse)
async def billing_checkpoint_usage(tenant: CurrentTenant, control: Control,
                                   project_id: str | None = None) -> JSONResponse:
    """Checkpoints stored now, by project and owner."""
    items = await control.checkpoint_storage(tenant, project_id)
    return wire_json(CurrentCheckpointStorageUsageResponse(data=[
        CurrentCheckpointStorageUsageItem(
            project_id=i.project_id, org_user_urn=f"tml:user:{i.owner}", user_name=i.owner,
            checkpoint_count=i.checkpoint_count, size_bytes=i.size_bytes, size_gigabytes=i.size_bytes / GIGABYTE,
        ) for i in items
    ]))


def _utc(ts: datetime) -> datetime:
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)
