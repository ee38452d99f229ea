"""JSON response bodies the SDK validates: direct answers (§2, §4) and `retrieve_future` results (§3).

Names and field names follow `tinker.types`. The SDK validates every JSON answer against its models
(required fields present, `type` literals equal, extra keys ignored), so required fields here are
required too. Serialize with `model.model_dump(mode="json")`: every `None` left in is valid for the SDK.
Proto-typed results (`ForwardBackwardOutput`, `SampleResponse`) are not here: see
`services.wire.results` and `services.wire.proto`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from services.wire.inputs import WireResponse


class ClientConfigResponse(WireResponse):
    """Answer of `client/config`: server-side feature flags (all optional for the SDK)."""

    pjwt_auth_enabled: bool = False
    """JWT exchange; we validate `X-API-Key` directly."""
    credential_default_source: str = "api_key"
    """Where the JWT exchange takes its credential from."""
    sample_dispatch_bytes_semaphore_size: int = 10 * 1024 * 1024
    """Client-side sampling request budget (bytes)."""
    inflight_response_bytes_semaphore_size: int = 50 * 1024 * 1024
    """Client-side budget reserved by `complete_metadata` answers (bytes)."""
    parallel_fwdbwd_chunks: bool = True
    """Send the chunks of one forward_backward concurrently (chunk 1 last)."""
    proto_compress_fwdbwd: bool = False
    """Ask the SDK to zstd-compress protobuf forward_backward bodies."""
    fwdbwd_max_chunk_len: int = 1024
    """Most datums per forward_backward request."""
    fwdbwd_max_chunk_bytes_count: int = 5_000_000
    """Most estimated protobuf bytes per forward_backward request."""
    fwdbwd_dispatch_bytes_semaphore_size: int = 50_000_000
    """Client-side in-flight forward_backward body budget (bytes)."""
    billing_exception_max_pause_duration_sec: int = 3600
    """How long HTTP 402 pauses a client."""
    sample_no_retries: bool = False
    """Disable the SamplingClient retry handler."""
    sample_enable_stuck_detection: bool = True
    """Fail sampling after 120 min without progress."""
    sample_max_concurrent_requests: int = 2000
    """SamplingClient concurrency cap."""
    use_pyqwest_transport: bool = False
    """False: plain httpx transport (recommended for self-hosted servers; the SDK default is true)."""
    sample_use_retrieve_futures: bool = False
    """Use the `retrieve_futures` batch poller."""
    custom_loss_server_side: bool = False
    """Upload traced custom losses (`create_custom_loss`)."""
    sample_join_sampling_session: bool = False
    """Unpickled SamplingClients call `join_sampling_session`."""


class ClientDynamicConfigResponse(WireResponse):
    """Answer of `client/dynamic_config` (re-fetched every `refresh_interval_sec`)."""

    refresh_interval_sec: int = Field(default=300, ge=10)
    """Refresh period (the SDK's floor is 10 s)."""
    sample_cancel_enabled: bool = False
    """Abandoned samples send `cancel_future`."""
    sample_cancel_max_batch_size: int = 64
    """Parallel cancellations per drain."""


class CreateSessionResponse(WireResponse):
    """Answer of `create_session`; the messages are logged by the SDK at info/warning/error."""

    type: Literal["create_session"] = "create_session"
    info_message: str | None = None
    """Logged at info level."""
    warning_message: str | None = None
    """Logged at warning level (e.g. SDK version advice)."""
    error_message: str | None = None
    """Logged at error level."""
    session_id: str
    """The new session."""


class SessionHeartbeatResponse(WireResponse):
    """Answer of `session_heartbeat` (HTTP 410 instead means: session finished)."""

    type: Literal["session_heartbeat"] = "session_heartbeat"


class TelemetryResponse(WireResponse):
    """Answer of `telemetry`."""

    status: Literal["accepted"] = "accepted"


class AuthTokenResponse(WireResponse):
    """Answer of `auth/token` (JWT mode only)."""

    jwt: str
    """The exchanged token."""


class UntypedAPIFuture(WireResponse):
    """Immediate answer of every compute endpoint; the result comes from `retrieve_future`."""

    request_id: str
    """Opaque id, unique across request types."""
    model_id: str | None = None
    """Echo of the training model, when there is one."""
    sample_sequence_ids: list[str] | None = None
    """`asample` only, and required there: one id per sample, in output order."""


class TryAgainResponse(WireResponse):
    """`retrieve_future` answer for a pending request (HTTP 200, or as the body of a 408)."""

    type: Literal["try_again"] = "try_again"
    request_id: str
    """The pending request."""
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"] = "active"
    """Why it is pending; paused states are logged by the SDK."""
    queue_state_reason: str | None = None
    """Human-readable reason, logged with paused states."""


class CompleteMetadataResponse(WireResponse):
    """`retrieve_future` answer when allowed and the payload is large: the size, fetched next poll.

    Not an SDK model (the SDK reads the dict); honoured only while `allow_metadata_only` is true.
    """

    status: Literal["complete_metadata"] = "complete_metadata"
    response_payload_size: int = Field(ge=0)
    """Uncompressed payload bytes the client reserves before refetching."""


ErrorCategory = Literal["unknown", "server", "user"]


class RequestFailedResponse(WireResponse):
    """`retrieve_future` answer for a failed request (HTTP 200) → `tinker.RequestFailedError`."""

    error: str
    """Message shown to the user."""
    category: ErrorCategory = "user"
    """`user` for bad input, `server` for our faults."""


class CreateModelResponse(WireResponse):
    """Result of `create_model`."""

    model_id: str
    """`"{session_id}:train:{model_seq_id}"`."""
    type: Literal["create_model"] = "create_model"


class ModelData(WireResponse):
    """Model metadata inside `GetInfoResponse`; the SDK loads the tokenizer from it client-side."""

    arch: str | None = None
    """Architecture id (e.g. `qwen3`, `llama`)."""
    model_name: str | None = None
    """HF name; must be set (`TrainingClient.get_tokenizer` asserts it)."""
    tokenizer_id: str | None = None
    """HF tokenizer id (cut at the first `:` by the SDK)."""


class GetInfoResponse(WireResponse):
    """Answer of `get_info`."""

    type: Literal["get_info"] | None = "get_info"
    model_data: ModelData
    """Model metadata."""
    model_id: str
    """Training run id."""
    optimizer_config: dict[str, Any] = {"type": "adamw"}
    """Optimizer family fixed at creation."""
    is_lora: bool | None = None
    """Always true here."""
    lora_rank: int | None = None
    """The adapter's rank."""
    model_name: str | None = None
    """Base model name."""


class OptimStepResponse(WireResponse):
    """Result of `optim_step`."""

    metrics: dict[str, float] | None = None
    """Step metrics (`name:reduction` keys)."""


class SaveWeightsResponse(WireResponse):
    """Result of `save_weights`."""

    path: str
    """`tinker://<model_id>/weights/<name>`."""
    type: Literal["save_weights"] | None = "save_weights"


class SaveWeightsForSamplerResponseInternal(WireResponse):
    """Result of `save_weights_for_sampler` (the SDK validates this *Internal* model)."""

    path: str | None = None
    """Named form: `tinker://<model_id>/sampler_weights/<name>` (required when the request had `path`)."""
    sampling_session_id: str | None = None
    """Ephemeral form: the new sampling session (required with `sampling_session_seq_id`)."""
    type: Literal["save_weights_for_sampler"] | None = "save_weights_for_sampler"


class SaveWeightsExternalResponseInternal(WireResponse):
    """Result of `save_weights_external` (the SDK validates this *Internal* model)."""

    path: str | None = None
    """`tinker://<model_id>/external_weights/<name>` (always set in practice)."""
    size_bytes: int | None = None
    """Total bytes exported."""
    type: Literal["save_weights_external"] | None = "save_weights_external"


class LoadWeightsResponse(WireResponse):
    """Result of `load_weights` (both addressing modes)."""

    path: str | None = None
    """The loaded checkpoint."""
    model_id: str | None = None
    """The model the weights were loaded onto."""
    type: Literal["load_weights"] | None = "load_weights"


class UnloadModelResponse(WireResponse):
    """Result of `unload_model`."""

    model_id: str
    """The unloaded model."""
    type: Literal["unload_model"] | None = "unload_model"


class CreateCustomLossResponse(WireResponse):
    """Result of `create_custom_loss`."""

    loss_id: str
    """Id used as `loss_fn_config_v2["loss_id"]`."""
    type: Literal["create_custom_loss"] = "create_custom_loss"


class CreateSamplingSessionResponse(WireResponse):
    """Answer of `create_sampling_session`."""

    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: str
    """`"{session_id}:sample:{sampling_session_seq_id}"`."""


class GetSamplerResponse(WireResponse):
    """Answer of `GET samplers/{sampler_id}`."""

    sampler_id: str
    """The sampling session id."""
    base_model: str
    """Base model (required: the SDK reads it)."""
    model_path: str | None = None
    """Weights the session samples, when not the base model."""


class JoinSamplingSessionResponse(WireResponse):
    """Answer of `join_sampling_session`."""

    type: Literal["join_sampling_session"] = "join_sampling_session"
    client_counter: int = Field(ge=1)
    """Clone id unique within the session (the original client is 0)."""


class FutureFinished(WireResponse):
    """A finished request in a `retrieve_futures` answer."""

    state: Literal["finished"] = "finished"
    request_id: str
    """The finished request."""
    response_payload_uncompressed_size: int | None = None
    """Payload bytes the client reserves before fetching."""


class FutureFailed(WireResponse):
    """A failed request in a `retrieve_futures` answer."""

    state: Literal["failed"] = "failed"
    request_id: str
    """The failed request."""


class FuturesRetrieveResponse(WireResponse):
    """Answer of `retrieve_futures`: only the target's completions; `cursor` unchanged if none."""

    completions: list[FutureFinished | FutureFailed]
    """New completions since `prev_cursor`."""
    cursor: int = Field(ge=0)
    """Pass back as `prev_cursor`."""
