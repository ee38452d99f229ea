"""Wire bodies of session search (`POST sessions/search`) and the `AdminClient` calls (`audit`,
`billing/usage/events`, `billing/usage/checkpoints/current`), named after `tinker.types`.

Search requests are strict like every request model; answers are what the SDK validates (tolerant types
there: every field the SDK marks optional may be omitted).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field

from services.wire.inputs import Id, WireRequest, WireResponse

MAX_SEARCH_LIMIT = 200


class SearchStatus(WireRequest):
    """One status a search matches: `active`, `client_finished` (optionally by reason), `failed`, `cancelled`."""

    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = Field(default=None, min_length=1)
    """`client_finished` only: the client-reported reasons to match."""


class SearchOwner(WireRequest):
    """Whose sessions: `own`, `accessible` (a tenant can access only its own) or listed `user` URNs."""

    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[str] | None = Field(default=None, min_length=1, max_length=10)


class SessionSearchCursor(WireRequest):
    last_created_at: datetime
    """`created_at` of the previous page's last session."""
    last_session_id: Id


class SessionSearchRequest(WireRequest):
    """Body of `POST sessions/search`."""

    session_id: Id | None = None
    project_ids: list[Id] | None = Field(default=None, max_length=100)
    user_metadata: dict[str, str] = Field(default_factory=dict, max_length=32)
    display_name: str | None = Field(default=None, min_length=1, max_length=200)
    owner: SearchOwner = SearchOwner()
    statuses: list[SearchStatus] | None = Field(default=None, min_length=1, max_length=8)
    limit: int = Field(default=50, ge=1, le=MAX_SEARCH_LIMIT)
    cursor: SessionSearchCursor | None = None


class SessionStatusWire(WireResponse):
    type: Literal["active", "client_finished"]
    reason: dict[str, str] | None = None
    """`client_finished` only: `{"type": "success" | ...}`."""


class SessionSummary(WireResponse):
    session_id: str
    created_at: datetime
    owner: str
    project_id: str
    status: SessionStatusWire | None = None
    checkpoints_count: int
    display_name: str | None = None
    user_metadata: dict[str, str] | None = None
    checkpoint_storage_bytes: int | None = None


class SessionSearchCursorOut(WireResponse):
    last_created_at: datetime
    last_session_id: str


class SessionSearchResponse(WireResponse):
    """Answer of `POST sessions/search`: one page, newest first."""

    sessions: list[SessionSummary]
    next_cursor: SessionSearchCursorOut | None = None


class AuditLogEntry(WireResponse):
    timestamp: datetime
    event: str
    """`<resource>_<action>`, e.g. `checkpoint_copied`."""
    event_details: dict[str, Any] = {}
    model_id: str | None = None
    """Deprecated in the SDK (read `event_details`); never set."""
    tinker_path: str | None = None
    purpose: str | None = None


class AuditLogResponse(WireResponse):
    """Answer of `GET audit`: one UTC day's entries, oldest first."""

    entries: list[AuditLogEntry]


class BillingEventInfo(WireResponse):
    type: Literal["training", "sampling_prefill", "sampling_sample", "checkpoint", "storage"]
    token_count: int | None = None
    count: int | None = None
    cached: bool | None = None


class BillingUsageEvent(WireResponse):
    bucket_start: datetime
    bucket_end: datetime
    base_model: str | None = None
    user_id: str | None = None
    user_name: str | None = None
    session_id: str | None = None
    project_id: str | None = None
    estimated_cost_usd: float | None = None
    """No prices here: always None."""
    effective_rate_usd_per_million_tokens: float | None = None
    effective_rate_usd_per_gigabyte_month: float | None = None
    event_info: BillingEventInfo


class BillingUsageResponse(WireResponse):
    """Answer of `GET billing/usage/events`: hourly buckets in the window."""

    data: list[BillingUsageEvent]
    sessions: dict[str, dict[str, Any]] = {}
    cost_data_through: datetime | None = None


class CurrentCheckpointStorageUsageItem(WireResponse):
    project_id: str | None = None
    org_user_urn: str | None = None
    user_email: str | None = None
    user_name: str | None = None
    checkpoint_count: int
    size_bytes: int
    size_gigabytes: float
    estimated_monthly_cost_usd: float | None = None


class CurrentCheckpointStorageUsageResponse(WireResponse):
    """Answer of `GET billing/usage/checkpoints/current`."""

    effective_rate_usd_per_gigabyte_month: float | None = None
    data: list[CurrentCheckpointStorageUsageItem]
