"""What the control plane answers for the rest of the SDK surface: batched completions, session search,
session traces, the admin audit log, billing usage and checkpoint storage.

Plain dataclasses with no dependency on the rest of the control plane, so `api.py` can name them in the
`ControlPlane` Protocol and the parts that compute them can import `api.py` without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal


@dataclass(frozen=True)
class CustomLossCreated:
    """`create_custom_loss` finished: the id `forward_backward` names with `loss_fn_config.loss_id`."""

    loss_id: str


@dataclass(frozen=True)
class FutureCompletionView:
    request_id: str
    failed: bool


@dataclass(frozen=True)
class CompletionsPage:
    completions: list[FutureCompletionView]
    cursor: int


@dataclass(frozen=True)
class SessionSearch:
    session_id: str | None = None
    display_name: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)
    statuses: list[str] | None = None
    """`active`, `client_finished` (and `failed` / `cancelled`, which never match here)."""
    limit: int = 50
    after: tuple[datetime, str] | None = None
    """(created_at, session id) of the previous page's last session."""


@dataclass(frozen=True)
class SessionSummaryView:
    session_id: str
    created_at: datetime
    owner: str
    project_id: str
    finished: bool
    checkpoints_count: int
    checkpoint_storage_bytes: int
    display_name: str | None
    user_metadata: dict[str, str]


@dataclass(frozen=True)
class TraceExport:
    """A session's requests as a Chrome/Perfetto trace (`traceEvents`), served at a signed URL."""

    url: str


@dataclass(frozen=True)
class AuditView:
    timestamp: datetime
    event: str
    details: dict[str, Any]


@dataclass(frozen=True)
class BillingEventView:
    bucket_start: datetime
    kind: Literal["training", "sampling_prefill", "sampling_sample", "checkpoint"]
    quantity: int
    base_model: str | None = None
    session_id: str | None = None
    user_id: str | None = None


@dataclass(frozen=True)
class StorageUsageView:
    project_id: str | None
    owner: str
    checkpoint_count: int
    size_bytes: int
