"""REST endpoint bodies (§4.12): training runs, checkpoints, sessions, capabilities, weights info.

Both directions: the few JSON request bodies of the REST calls (`ttl`, `project`, `weights_info`,
`copy_weights`) and the listing / lookup answers the `RestClient` validates. Names follow
`tinker.types`; bodies the SDK sends as plain dicts get descriptive names.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field, model_validator

from services.wire.inputs import Id, TinkerUri, TtlSeconds, WireRequest, WireResponse
from services.wire.paths import CheckpointType

AccessScope = Literal["owned", "accessible"]
"""`access_scope` query parameter of the listing endpoints."""

DEFAULT_RUNS_LIMIT = 20
"""`limit` default of `GET training_runs`."""
DEFAULT_CHECKPOINTS_LIMIT = 100
"""`limit` default of `GET checkpoints`."""


class SetCheckpointTtlRequest(WireRequest):
    """Body of `PUT training_runs/{id}/checkpoints/{checkpoint_id}/ttl`."""

    ttl_seconds: TtlSeconds | None
    """New expiry from now, 3600 s .. 10 years; null removes the TTL."""


class AssignSessionProjectRequest(WireRequest):
    """Body of `PUT sessions/{session_id}/project`."""

    project_id: Id
    """Destination project."""


class WeightsInfoRequest(WireRequest):
    """Body of `POST weights_info`."""

    tinker_path: TinkerUri
    """Checkpoint to describe."""


class CopyWeightsRequest(WireRequest):
    """Body of `POST copy_weights`: to a project, or into a session's model slot."""

    session_id: Id | None = None
    """Session that will own the copy (with `model_seq_id`)."""
    model_seq_id: int | None = Field(default=None, ge=0)
    """Training-run slot within that session."""
    destination_project_id: Id | None = None
    """Project that will own the copy when no session is given."""
    source_path: TinkerUri
    """Weights to copy (either kind)."""
    ttl_seconds: TtlSeconds | None = None
    """Expiry of the copy; None = never."""
    weights_access_token: str | None = None
    """Token for weights owned by another account."""

    @model_validator(mode="after")
    def _one_destination(self) -> CopyWeightsRequest:
        by_session = self.session_id is not None or self.model_seq_id is not None
        if by_session and (self.session_id is None or self.model_seq_id is None):
            raise ValueError("session_id and model_seq_id must be set together")
        if by_session == (self.destination_project_id is not None):
            raise ValueError("set destination_project_id, or session_id + model_seq_id (not both)")
        return self


class Cursor(WireResponse):
    """Offset pagination state."""

    offset: int = Field(ge=0)
    """Offset of this page."""
    limit: int = Field(ge=0)
    """Page size asked for."""
    total_count: int = Field(ge=0)
    """Items in all pages."""


class Checkpoint(WireResponse):
    """One checkpoint in a listing."""

    checkpoint_id: str
    """`<segment>/<name>`, e.g. `weights/ckpt1`."""
    checkpoint_type: CheckpointType
    """training | sampler | external."""
    time: datetime
    """Creation time."""
    tinker_path: str
    """`tinker://<run>/<segment>/<name>`."""
    size_bytes: int | None = None
    """Stored bytes."""
    public: bool = False
    """Readable by other accounts."""
    user_metadata: dict[str, str] | None = None
    """Metadata attached at save time."""
    expires_at: datetime | None = None
    """Expiry; None = never."""


class TrainingRun(WireResponse):
    """One training run (= training model)."""

    training_run_id: str
    """`"{session_id}:train:{model_seq_id}"`."""
    base_model: str
    """Base model name."""
    model_owner: str
    """Owning account."""
    is_lora: bool
    """Always true here."""
    corrupted: bool = False
    """The run's state is unusable."""
    lora_rank: int | None = None
    """Adapter rank."""
    last_request_time: datetime
    """Time of the last request (required by the SDK)."""
    last_checkpoint: Checkpoint | None = None
    """Newest `weights/` checkpoint."""
    last_sampler_checkpoint: Checkpoint | None = None
    """Newest `sampler_weights/` checkpoint."""
    user_metadata: dict[str, str] | None = None
    """Metadata given at creation."""


class TrainingRunsResponse(WireResponse):
    """Answer of `GET training_runs`."""

    training_runs: list[TrainingRun]
    """This page."""
    cursor: Cursor
    """Pagination (required here)."""


class CheckpointsListResponse(WireResponse):
    """Answer of `GET training_runs/{id}/checkpoints` and `GET checkpoints` (newest first)."""

    checkpoints: list[Checkpoint]
    """This page."""
    cursor: Cursor | None = None
    """Pagination; None when unpaginated."""


class SupportedModel(WireResponse):
    """One base model in the capabilities answer."""

    model_name: str | None = None
    """Base model name."""
    max_context_length: int | None = None
    """Longest sequence in tokens."""
    trainable: bool | None = None
    """Training runs can be created on it."""
    sampleable: bool | None = None
    """It has sampling capacity."""


class GetServerCapabilitiesResponse(WireResponse):
    """Answer of `GET get_server_capabilities`."""

    supported_models: list[SupportedModel]
    """Served base models."""


class HealthResponse(WireResponse):
    """Answer of `GET healthz`."""

    status: Literal["ok"] = "ok"


class WeightsInfoResponse(WireResponse):
    """Answer of `POST weights_info`."""

    base_model: str
    """Base model of the checkpoint."""
    optimizer_config: dict[str, str | int] = {"type": "adamw"}
    """Optimizer family of the run."""
    is_lora: bool
    """Always true here."""
    lora_rank: int | None = None
    """Adapter rank."""
    train_unembed: bool | None = None
    """Adapter covers the unembedding."""
    train_mlp: bool | None = None
    """Adapter covers the MLP."""
    train_attn: bool | None = None
    """Adapter covers attention."""


class ExternalWeightsUrlsResponse(WireResponse):
    """Answer of `GET .../checkpoints/external_weights/<name>/external_weights_urls`."""

    urls: dict[str, str]
    """Signed URL per file path relative to the export root."""
    expires: datetime
    """When the URLs stop working."""


class CopyWeightsResponse(WireResponse):
    """Answer of `POST copy_weights`."""

    tinker_path: str
    """Path of the copy."""


class ListSessionsResponse(WireResponse):
    """Answer of `GET sessions`."""

    sessions: list[str]
    """Session ids."""


class GetSessionResponse(WireResponse):
    """Answer of `GET sessions/{session_id}`."""

    training_run_ids: list[str]
    """The session's training runs."""
    sampler_ids: list[str]
    """The session's sampling sessions."""
    user_metadata: dict[str, str] | None = None
    """Metadata given at creation."""
    display_name: str | None = None
    """Display name given at creation."""


class SessionTraceExportResponse(WireResponse):
    """Answer of `GET sessions/{session_id}/trace_export` (SDK: `_SessionTraceExportPollResponse`)."""

    status: Literal["pending", "ready", "failed"]
    """Export job state; the SDK polls every 5 s while pending."""
    url: str | None = None
    """Download URL, required when ready."""
    error: str | None = None
    """Failure text when failed."""
