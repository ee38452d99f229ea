"""Gateway configuration: `GatewaySettings`, read from `CARPOOL_*` environment variables.

Owns every knob of the HTTP edge — long-poll length, body limits, the public URL used for signed
download links, authentication caching, and the feature flags handed to SDK clients through
`client/config` and `client/dynamic_config`. Nothing here is instantiated at import time: the
composition root builds one `GatewaySettings()` and passes it to `gateway.app.create_app`.
"""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MIB = 1024 * 1024
SDK_RETRIEVE_TIMEOUT_S = 45.0
"""Client read timeout of `retrieve_future` in SDK 0.38; a long-poll must answer well before it."""


class GatewaySettings(BaseSettings):
    """Settings of the HTTP gateway (env prefix `CARPOOL_`, e.g. `CARPOOL_LONG_POLL_SECONDS=20`)."""

    model_config = SettingsConfigDict(env_prefix="CARPOOL_", extra="ignore", frozen=True)

    # -- futures --------------------------------------------------------------------------------
    long_poll_seconds: float = Field(
        default=25.0,
        gt=0,
        lt=SDK_RETRIEVE_TIMEOUT_S - 5,
        description="How long `retrieve_future` holds a request for a pending future before answering "
        "`try_again` (the SDK re-polls at once; its read timeout is 45 s).",
    )
    sample_render_cache_size: int = Field(
        default=100_000,
        ge=0,
        description="How many `asample` requests' rendering options (top-k width, `prompt_logprobs_last_n`) "
        "the gateway remembers until their result is fetched; only non-default requests use a slot.",
    )

    # -- request limits ---------------------------------------------------------------------------
    max_body_bytes: int = Field(
        default=64 * MIB,
        ge=1024,
        description="Largest request body, compressed or not (bigger answers HTTP 413); also caps a zstd "
        "forward_backward body after decompression.",
    )
    max_small_body_bytes: int = Field(
        default=1 * MIB,
        ge=1024,
        description="Largest body of every route except forward_backward, forward and sampling (which take "
        "max_body_bytes): create_model, saves, sessions and REST bodies are small JSON.",
    )
    max_loss_input_elements: int = Field(
        default=1 << 24,
        ge=1,
        description="Most dense elements of one forward_backward request's loss inputs, all tensors together "
        "(sparse tensors counted at their dense shape); checked before anything is allocated (400).",
    )
    max_target_k: int = Field(
        default=64,
        ge=1,
        description="Largest K of a (T, K) loss input such as target_tokens (400 above it).",
    )
    decode_threads: int = Field(
        default=4,
        ge=1,
        description="Threads of the gateway's own pool that decode forward_backward bodies (off the event loop "
        "and off the default pool that database work uses).",
    )
    blocking_threads: int = Field(
        default=16,
        ge=1,
        description="Threads of the gateway's pool for blocking control-plane work (database transactions, "
        "API-key lookups); never more are started, further work waits, served round robin per API key so one "
        "caller's flood does not delay the others.",
    )
    auth_failure_cache_seconds: float = Field(
        default=2.0,
        ge=0,
        description="How long a failed API-key lookup is remembered (by a digest of the key) so repeats of a bad "
        "key skip the database; 0 = not remembered.",
    )
    auth_failure_cache_size: int = Field(default=10_000, ge=0, description="Most remembered failed key lookups.")
    edge_max_in_flight: int | None = Field(
        default=2048,
        ge=1,
        description="Requests one API key may have open at once on this gateway process, long-polls included "
        "(429 with Retry-After above it); None = no limit.",
    )
    edge_rate_per_second: float | None = Field(
        default=500.0,
        gt=0,
        description="Requests per second one API key may send to this gateway process (token bucket of "
        "edge_rate_burst; 429 with Retry-After); None = no limit.",
    )
    edge_rate_burst: int = Field(default=2000, ge=1, description="Bucket size of edge_rate_per_second.")
    edge_failed_auth_per_minute: float | None = Field(
        default=30.0,
        gt=0,
        description="Failed authentications one client address may make per minute (after a burst of "
        "edge_failed_auth_burst); beyond that its requests with unproven keys get 429. None = no limit.",
    )
    edge_failed_auth_burst: int = Field(
        default=30, ge=1, description="Failed authentications one address may make before being slowed."
    )
    default_max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="`max_tokens` of a sampling request that leaves it unset; None = the domain default.",
    )

    # -- URLs, docs, metrics ----------------------------------------------------------------------
    public_base_url: str | None = Field(
        default=None,
        description="Externally visible base URL (e.g. `https://carpool.example.com`) used to build signed "
        "download links; None = taken from each request's own URL.",
    )
    docs_enabled: bool = Field(default=True, description="Serve OpenAPI at `/openapi.json` and `/docs`.")
    hot_routes: bool = Field(
        default=True,
        description="Serve the per-step SDK routes (`retrieve_future`, `forward_backward`, `optim_step`, "
        "`asample`, `retrieve_futures`, `session_heartbeat`) straight from the edge middleware, past FastAPI's "
        "routing and dependency layers: the same endpoints, less CPU and memory per request in flight.",
    )
    metrics_enabled: bool = Field(
        default=True, description="Serve per-route request counters and latency histograms at `/metrics`."
    )
    otel_telemetry: bool = Field(
        default=False,
        description="Let FastAPI's native OpenTelemetry instrumentation (FastAPI >= 0.165) emit spans, metrics and "
        "logs when an OpenTelemetry provider is configured in the process. Off by default: Carpool's metrics are "
        "Prometheus (`/metrics`), and with it on FastAPI checks the global providers on every request.",
    )
    admin_enabled: bool = Field(
        default=True, description="Serve the operators' web dashboard at `/admin` (log in with an admin API key)."
    )
    admin_session_minutes: int = Field(
        default=480, ge=1, le=7 * 24 * 60,
        description="Lifetime of a dashboard login; it also ends at logout or when its API key is revoked.",
    )
    admin_page_size: int = Field(
        default=50, ge=5, le=500, description="Rows per page of the dashboard's listings (paged on the server)."
    )

    # -- authentication ---------------------------------------------------------------------------
    auth_cache_seconds: float = Field(
        default=5.0,
        ge=0,
        description="How long a successful API-key lookup is reused (0 = look up every request); bounds "
        "how long a revoked key keeps working on other replicas. Keys in use are re-checked together, in one "
        "statement, every half of this.",
    )
    auth_cache_size: int = Field(default=10_000, ge=0, description="Most cached API-key lookups.")

    # -- sessions ---------------------------------------------------------------------------------
    min_sdk_version: str = Field(
        default="0.38.0",
        pattern=r"^\d+(\.\d+)*$",
        description="Older SDKs get a `warning_message` from `create_session` (they may not speak this "
        "server's protocol).",
    )

    # -- client/config flags (handed to the SDK) ----------------------------------------------------
    use_pyqwest_transport: bool = Field(
        default=False,
        description="Let the SDK use its pyqwest transport; plain httpx (false) avoids reqwest quirks.",
    )
    proto_compress_fwdbwd: bool = Field(
        default=False, description="Ask the SDK to zstd-compress protobuf forward_backward bodies."
    )
    parallel_fwdbwd_chunks: bool = Field(
        default=True,
        description="Let the SDK send the chunks of one forward_backward concurrently (chunk 1 last).",
    )
    fwdbwd_max_chunk_len: int = Field(default=1024, ge=1, description="Most datums per forward_backward request.")
    fwdbwd_max_chunk_bytes_count: int = Field(
        default=5_000_000,
        ge=1024,
        description="Most estimated protobuf bytes per forward_backward request (must fit max_body_bytes).",
    )
    sample_max_concurrent_requests: int = Field(
        default=2000, ge=1, description="Concurrency cap of each SDK SamplingClient."
    )
    sample_batch_poller: bool = Field(
        default=True,
        description="Advertise the SDK's batched sampling poller (`sample_use_retrieve_futures`): one held "
        "`retrieve_futures` per sampling client instead of a long-poll per outstanding sample, for about two "
        "more requests and three database looks per sample (docs/performance.md, session 31).",
    )

    # -- client/dynamic_config flags ----------------------------------------------------------------
    dynamic_config_refresh_seconds: int = Field(
        default=300, ge=10, description="How often SDK clients re-fetch `client/dynamic_config`."
    )
    sample_cancel_enabled: bool = Field(
        default=False, description="Let SDK clients send `cancel_future` for abandoned samples."
    )
    jwt_auth_enabled: bool = Field(
        default=False,
        description="Tell SDK clients to use JWT mode (`pjwt_auth_enabled`): they exchange their API key at "
                    "`auth/token` for short-lived JWTs and send those. `auth/token` is served either way.",
    )

    @model_validator(mode="after")
    def _chunks_fit_body(self) -> GatewaySettings:
        # The SDK's byte estimate is approximate; keep a 2x margin so a full chunk is never a 413.
        if self.fwdbwd_max_chunk_bytes_count * 2 > self.max_body_bytes:
            raise ValueError(
                f"fwdbwd_max_chunk_bytes_count ({self.fwdbwd_max_chunk_bytes_count}) must be at most half "
                f"of max_body_bytes ({self.max_body_bytes})"
            )
        return self

    def sdk_version_is_old(self, sdk_version: str | None) -> bool:
        """Whether `sdk_version` (e.g. `0.37.2`) is older than `min_sdk_version`; unknown → False."""
        parsed = _version_tuple(sdk_version)
        return parsed is not None and parsed < (_version_tuple(self.min_sdk_version) or ())


def _version_tuple(version: str | None) -> tuple[int, ...] | None:
    if not version:
        return None
    parts: list[int] = []
    for part in version.split("."):
        # ASCII digits only: `str.isdigit` is also true of "²" or "١", which `int` refuses (a 500 on
        # POST /v1/sessions that schemathesis found).
        digits = "".join(ch for ch in part if ch in "0123456789")
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(part):  # `0.38.0rc1` → (0, 38, 0)
            break
    return tuple(parts) or None
