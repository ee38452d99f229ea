"""Client-plumbing request bodies: client config, session lifecycle, future polling, telemetry.

Everything the SDK sends that is not a model or sampler operation (those are in
`services.wire.requests`): `client/config`, `create_session`, `session_heartbeat`,
`sessions/{id}/finish`, `retrieve_future(s)`, `cancel_future`, `telemetry`. Names follow `tinker.types`;
bodies the SDK sends as plain dicts get descriptive names. Extra-key policy: see `services.wire.inputs`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from services.wire.inputs import Id, Tags, UserMetadata, WireRequest


class ClientConfigRequest(WireRequest):
    """Body of `client/config` and `client/dynamic_config`."""

    sdk_version: str | None = None
    """SDK version, e.g. `0.38.0` (always sent by 0.38; optional here)."""


class CreateSessionRequest(WireRequest):
    """Body of `create_session`."""

    tags: Tags = []
    """Free-form tags (`TINKER_TAGS`)."""
    user_metadata: UserMetadata | None = None
    """Caller's metadata (`{}` when none)."""
    sdk_version: str | None = None
    """SDK version; optional here so that version advice can still be given to odd clients."""
    project_id: str | None = None
    """Project that owns the session."""
    display_name: str | None = None
    """Human-readable name, for display and search only."""
    type: Literal["create_session"] = "create_session"


class SessionHeartbeatRequest(WireRequest):
    """Body of `session_heartbeat` (every 10 s)."""

    session_id: Id
    """The live session."""
    type: Literal["session_heartbeat"] = "session_heartbeat"


class SessionFinishReason(WireRequest):
    """Why the client closed the session."""

    type: Literal["success", "errored", "interrupted"]
    """Close status passed to `ServiceClient.close`."""


class SessionFinishRequest(WireRequest):
    """Body of `sessions/{session_id}/finish` (SDK sends a plain dict; mirrors `ClientSessionFinished`)."""

    reason: SessionFinishReason
    """Close status."""
    detail: str | None = None
    """Optional free text from the client."""


class FutureRetrieveRequest(WireRequest):
    """Body of `retrieve_future` (long-poll)."""

    request_id: Id
    """The future to fetch."""
    allow_metadata_only: bool = False
    """The server may answer `complete_metadata` (size only) instead of a large payload."""


class SamplingSessionFuturesTarget(WireRequest):
    """What `retrieve_futures` polls: one sampling session (or one clone of it)."""

    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: Id
    """Polled sampling session."""
    cloned_sampler_id: int = Field(default=0, ge=0)
    """Clone number (`seq_id // 10**9`); 0 = the original client."""


class FuturesRetrieveRequest(WireRequest):
    """Body of `retrieve_futures` (batch poller, only if enabled in client config)."""

    target: SamplingSessionFuturesTarget
    """Polled sampling session."""
    prev_cursor: int = Field(default=0, ge=0)
    """Cursor of the previous answer; events at or before it are acknowledged."""
    timeout: float | None = Field(default=None, ge=0)
    """0 = ack-only poll (answer at once); None = long-poll."""
    retrieved_request_ids: list[str] = []
    """Requests whose payloads the client has fully fetched."""


class CancelFutureRequest(WireRequest):
    """Body of `cancel_future` (SDK sends a plain dict; only if enabled in dynamic config)."""

    request_id: Id
    """The abandoned future."""


class TelemetryEvent(WireRequest):
    """One SDK telemetry event; lenient (telemetry must never fail a client), unknown keys ignored."""

    model_config = ConfigDict(strict=False)

    event: str
    """`SESSION_START` | `SESSION_END` | `UNHANDLED_EXCEPTION` | `GENERIC_EVENT`."""
    event_id: str
    """Client-side event id."""
    event_session_index: int
    """Position of the event in the client's session."""
    severity: str
    """`DEBUG` .. `CRITICAL`."""
    timestamp: str
    """ISO-8601 time (kept as text)."""
    event_name: str | None = None
    """GENERIC_EVENT: low-cardinality name (e.g. `APIFuture.result_async.validation_error`)."""
    event_data: dict[str, Any] | None = None
    """GENERIC_EVENT: free JSON."""
    duration: str | None = None
    """SESSION_END: ISO-8601 duration."""
    error_message: str | None = None
    """UNHANDLED_EXCEPTION: message."""
    error_type: str | None = None
    """UNHANDLED_EXCEPTION: exception class."""
    traceback: str | None = None
    """UNHANDLED_EXCEPTION: traceback text."""


class TelemetrySendRequest(WireRequest):
    """Body of `telemetry` (batches of <= 100 events)."""

    model_config = ConfigDict(strict=False)

    events: list[TelemetryEvent]
    """The batch."""
    platform: str
    """Host platform."""
    sdk_version: str
    """SDK version."""
    session_id: str
    """Session id, or `sessionless-...` for RestClient."""
    process_uuid: str
    """Client process id."""
