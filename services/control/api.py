"""The contract between the gateway (HTTP, wire formats) and the service core (db, queue, storage).

The gateway authenticates, decodes wire bodies into domain types, and calls a `ControlPlane`; it
never touches the db, the queue or storage directly. Every call takes the caller's `Tenant` and
every id it names is checked against that tenant: an id of another tenant raises `NotFound`, exactly
as an id that does not exist. Operations that run on a worker return a `RequestId` at once (a Tinker
future); `retrieve` long-polls for the outcome.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date, datetime
from pathlib import Path
from typing import Literal, Protocol

from services.auth.tenants import Tenant
from services.control.surface_views import (
    AuditView,
    BillingEventView,
    CompletionsPage,
    CustomLossCreated,
    SessionSearch,
    SessionSummaryView,
    StorageUsageView,
    TraceExport,
)
from services.db.ids import ModelId, RequestId, SamplingSessionId, SessionId
from services.domain.backend import BaseModelInfo
from services.domain.sampling import SampleResult, SampleWork
from services.domain.training import AdamParams, ForwardBackwardResult, ForwardBackwardWork, LoraSpec

RequestKindName = Literal[
    "create_model", "forward", "forward_backward", "optim_step", "save_weights", "save_weights_for_sampler",
    "save_weights_external", "load_weights", "sample", "unload_model", "create_custom_loss",
]
CheckpointKindName = Literal["training", "sampler", "external"]


class ControlError(Exception):
    """Base of the errors the gateway maps to HTTP statuses."""

    status = 400

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class NotFound(ControlError):
    status = 404


class Invalid(ControlError):
    status = 400


class Conflict(ControlError):
    """A genuine conflict (e.g. a checkpoint name clash without overwrite); never for duplicate submissions."""

    status = 400


class QuotaExceeded(ControlError):
    status = 429

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(ControlError):
    status = 503


@dataclass(frozen=True)
class Submitted:
    """A future: the request id, plus the model it belongs to when there is one."""

    request_id: RequestId
    model_id: ModelId | None = None


@dataclass(frozen=True)
class SampleSubmitted:
    request_id: RequestId
    sample_sequence_ids: list[str]


@dataclass(frozen=True)
class Pending:
    """Not finished within the wait; `queue_state` is `active` or `paused_capacity` when saturated."""

    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"] = "active"


@dataclass(frozen=True)
class Failed:
    error: str
    category: Literal["user", "server"] = "user"


@dataclass(frozen=True)
class CheckpointRef:
    tinker_path: str
    kind: CheckpointKindName
    size_bytes: int | None = None


@dataclass(frozen=True)
class SamplerRef:
    sampling_session_id: SamplingSessionId


@dataclass(frozen=True)
class ModelCreated:
    model_id: ModelId


@dataclass(frozen=True)
class OptimStepDone:
    metrics: dict[str, float]


@dataclass(frozen=True)
class WeightsLoaded:
    """`load_weights` finished: `model_id` now holds the checkpoint at `tinker_path`."""

    model_id: ModelId
    tinker_path: str


Outcome = (
    ForwardBackwardResult | SampleResult | OptimStepDone | CheckpointRef | SamplerRef | ModelCreated
    | WeightsLoaded | CustomLossCreated
)
"""A finished request's domain result; the gateway renders it by the request's kind."""


@dataclass(frozen=True)
class Done:
    kind: RequestKindName
    result: Outcome


FutureState = Pending | Done | Failed


@dataclass(frozen=True)
class ModelInfo:
    model_id: ModelId
    base: BaseModelInfo
    lora: LoraSpec


@dataclass(frozen=True)
class SaveOptions:
    name: str | None
    """Checkpoint name; None for an ephemeral sampler snapshot."""
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointView:
    checkpoint_id: str
    """`weights/<name>`, `sampler_weights/<name>` or `external_weights/<name>`."""
    kind: CheckpointKindName
    tinker_path: str
    created_at: datetime
    size_bytes: int | None
    public: bool
    expires_at: datetime | None
    user_metadata: dict[str, str]


@dataclass(frozen=True)
class TrainingRunView:
    training_run_id: ModelId
    base_model: str
    model_owner: str
    lora: LoraSpec
    last_request_time: datetime
    corrupted: bool = False
    last_checkpoint: CheckpointView | None = None
    last_sampler_checkpoint: CheckpointView | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SessionView:
    session_id: SessionId
    training_run_ids: list[ModelId]
    sampler_ids: list[SamplingSessionId]
    user_metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Page:
    offset: int
    limit: int
    total_count: int


@dataclass(frozen=True)
class SignedUrls:
    urls: dict[str, str]
    """Relative file path → absolute URL (signed, expiring) the gateway serves."""
    expires: datetime


@dataclass(frozen=True)
class RuntimeStats:
    """Counters of one base model's scheduler loop since start (for /metrics and healthz)."""

    base_model: str
    running: bool
    passes: int = 0
    multi_tenant_passes: int = 0
    """Passes that carried more than one tenant's requests: the product working as intended."""
    tenants_per_pass_total: int = 0
    """Sum over passes of their tenant count; divide by `passes` for the mean."""
    tokens: int = 0
    barriers: int = 0
    sample_batches: int = 0
    requests_completed: int = 0
    requests_failed: int = 0
    last_pass_tokens_per_s: float = 0.0
    busy_seconds: float = 0.0
    queued: int = 0
    """Requests waiting in the queue or the scheduler."""

    @property
    def mean_tenants_per_pass(self) -> float:
        return self.tenants_per_pass_total / self.passes if self.passes else 0.0


class RuntimeIntrospection(Protocol):
    """Optional extra of a control plane: the scheduler loops' counters (`ServiceControlPlane` has it)."""

    def runtime_stats(self) -> list[RuntimeStats]: ...


class ControlPlane(Protocol):
    """Everything the gateway can ask of the service. All methods are async and tenant-scoped."""

    # -- sessions ----------------------------------------------------------------------------
    async def create_session(self, tenant: Tenant, *, tags: list[str], user_metadata: dict[str, object],
                             sdk_version: str | None, project_id: str | None) -> SessionId: ...
    async def heartbeat(self, tenant: Tenant, session_id: SessionId) -> None: ...
    async def finish_session(self, tenant: Tenant, session_id: SessionId) -> None: ...

    # -- training ----------------------------------------------------------------------------
    def base_models(self) -> list[BaseModelInfo]: ...
    async def create_model(self, tenant: Tenant, session_id: SessionId, model_seq_id: int, base_model: str,
                           lora: LoraSpec, user_metadata: Mapping[str, object] | None) -> Submitted: ...
    async def get_info(self, tenant: Tenant, model_id: ModelId) -> ModelInfo: ...
    def model_known_owned(self, tenant: Tenant, model_id: ModelId) -> bool:
        """From memory, no I/O: whether an earlier `get_info` found the model to be the tenant's (False: ask
        `get_info`). Thread-safe; only ever true for the tenant's own models."""
        ...
    async def forward_backward(self, tenant: Tenant, model_id: ModelId, seq_id: int,
                               work: ForwardBackwardWork) -> Submitted: ...
    async def optim_step(self, tenant: Tenant, model_id: ModelId, seq_id: int, params: AdamParams) -> Submitted: ...
    async def reject_seq_id(self, tenant: Tenant, model_id: ModelId, seq_id: int, error: str) -> None:
        """A submission refused at the edge still consumes its seq_id so later requests are not blocked."""
        ...
    async def save(self, tenant: Tenant, model_id: ModelId, seq_id: int, kind: CheckpointKindName,
                   options: SaveOptions, sampling_session_seq_id: int | None = None) -> Submitted: ...
    async def load(self, tenant: Tenant, *, path: str, with_optimizer: bool, model_id: ModelId | None = None,
                   seq_id: int | None = None, session_id: SessionId | None = None,
                   model_seq_id: int | None = None) -> Submitted: ...

    # -- sampling ----------------------------------------------------------------------------
    async def create_sampling_session(self, tenant: Tenant, session_id: SessionId, seq: int, *,
                                      model_path: str | None, base_model: str | None) -> SamplingSessionId: ...
    async def get_sampler(self, tenant: Tenant, sampler_id: SamplingSessionId) -> tuple[str, str | None]:
        """(base_model, model_path) of a sampling session."""
        ...
    async def sample(self, tenant: Tenant, sampler_id: SamplingSessionId, seq_id: int | None,
                     work: SampleWork) -> SampleSubmitted: ...

    # -- futures -----------------------------------------------------------------------------
    async def retrieve(self, tenant: Tenant, request_id: RequestId, timeout_s: float) -> FutureState: ...

    async def cancel(self, tenant: Tenant, request_id: RequestId) -> None: ...

    # -- runs, sessions, checkpoints (REST) --------------------------------------------------
    async def list_training_runs(self, tenant: Tenant, limit: int, offset: int,
                                 project_id: str | None = None) -> tuple[list[TrainingRunView], Page]:
        """The tenant's runs, newest first; with `project_id`, only those of that project's sessions."""
        ...
    async def get_training_run(self, tenant: Tenant, run_id: ModelId) -> TrainingRunView: ...
    async def list_sessions(self, tenant: Tenant, limit: int, offset: int) -> tuple[list[SessionId], Page]: ...
    async def get_session(self, tenant: Tenant, session_id: SessionId) -> SessionView: ...
    async def list_checkpoints(self, tenant: Tenant, run_id: ModelId | None, limit: int,
                               offset: int) -> tuple[list[CheckpointView], Page]:
        """One run's checkpoints, or (run_id None) all of the tenant's."""
        ...
    async def get_checkpoint(self, tenant: Tenant, tinker_path: str) -> tuple[CheckpointView, TrainingRunView]:
        """A checkpoint the tenant owns, or a published one (read-only)."""
        ...
    async def delete_checkpoint(self, tenant: Tenant, tinker_path: str) -> None: ...
    async def set_checkpoint_public(self, tenant: Tenant, tinker_path: str, public: bool) -> None: ...
    async def set_checkpoint_ttl(self, tenant: Tenant, tinker_path: str, ttl_seconds: int | None) -> None: ...
    async def external_weights_urls(self, tenant: Tenant, tinker_path: str, base_url: str) -> SignedUrls:
        """Signed, expiring download URLs (under `base_url`) for every file of a checkpoint."""
        ...
    async def open_signed_file(self, token: str) -> Path:
        """The local file a signed token names; raises NotFound when the token is bad or expired."""
        ...
    async def usage(self, tenant: Tenant) -> dict[str, float]: ...

    # -- the rest of the SDK surface (services/control/surface_views.py) -----------------------
    async def retrieve_futures(self, tenant: Tenant, sampling_id: SamplingSessionId, clone: int,
                               prev_cursor: int, timeout_s: float | None) -> CompletionsPage: ...
    async def join_sampling_session(self, tenant: Tenant, sampling_id: SamplingSessionId) -> int: ...
    async def create_custom_loss(self, tenant: Tenant, session_id: SessionId, seq: int, name: str,
                                 inputs: list[dict[str, object]], nodes: list[dict[str, object]]) -> Submitted: ...
    async def copy_weights(self, tenant: Tenant, source_path: str, *, session_id: SessionId | None,
                           model_seq_id: int | None, project_id: str | None, ttl_seconds: int | None,
                           source_owner: Tenant | None) -> str:
        """A copy of a checkpoint in one of the caller's runs; its `tinker://` path."""
        ...
    async def unload_model(self, tenant: Tenant, model_id: ModelId) -> Submitted: ...
    async def assign_session_project(self, tenant: Tenant, session_id: SessionId, project_id: str) -> None: ...
    async def search_sessions(self, tenant: Tenant, search: SessionSearch) -> list[SessionSummaryView]: ...
    async def export_session_trace(self, tenant: Tenant, session_id: SessionId, base_url: str) -> TraceExport: ...
    async def session_trace(self, token: str) -> dict[str, object]:
        """The Chrome/Perfetto trace a signed link names (NotFound if bad or expired)."""
        ...
    def mint_auth_token(self, tenant: Tenant) -> tuple[str, float]:
        """A short-lived JWT for the caller's key and its lifetime in seconds (`auth/token`)."""
        ...
    async def authenticate_token(self, token: str) -> Tenant | None:
        """The tenant of a live JWT whose key is not revoked; None otherwise."""
        ...
    async def audit_log(self, tenant: Tenant, event_type: str, day: date | None) -> list[AuditView]: ...
    async def billing_usage(self, tenant: Tenant, starting_on: datetime,
                            ending_before: datetime) -> list[BillingEventView]: ...
    async def checkpoint_storage(self, tenant: Tenant, project_id: str | None) -> list[StorageUsageView]: ...
