"""`ServiceSettings`: every knob of a Carpool service process, from `CARPOOL_*` environment variables.

Built on demand (`ServiceSettings()` reads the environment then; CLI options override it by keyword), never
at import time. `docs/configuration.md` and the Helm values map onto these fields one to one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from services.db.engine import database_url_for_data_dir, normalize_database_url
from services.jobqueue.protocol import DEFAULT_ANSWERED_KEEP_S
from services.scheduler.pacing import DEFAULT_PASS_LATENCY_FACTOR

DEFAULT_BASE_MODELS = ["HuggingFaceTB/SmolLM2-135M-Instruct=smollm2-135m"]


@dataclass(frozen=True)
class BaseModelSpec:
    """One served base model: the public `name` tenants ask for and the `source` that provides it."""

    name: str
    source: str


def parse_base_model(spec: str) -> BaseModelSpec:
    """`NAME=SOURCE` → spec; a bare default name (or its alias) stands for itself with its built-in source."""
    name, sep, source = spec.partition("=")
    name, source = name.strip(), source.strip()
    if sep and name and source:
        return BaseModelSpec(name, source)
    if not sep and name:
        for default in DEFAULT_BASE_MODELS:
            known = parse_base_model(default)
            if name in (known.name, known.source):
                return known
    raise ValueError(f"base model {spec!r} must be NAME=SOURCE, e.g. "
                     "HuggingFaceTB/SmolLM2-135M-Instruct=smollm2-135m or my-model=/models/my-model")


class ServiceSettings(BaseSettings):
    """Settings of `carpool serve` and the admin commands (env prefix `CARPOOL_`)."""

    model_config = SettingsConfigDict(env_prefix="CARPOOL_", extra="ignore")

    data_dir: Path = Field(Path("./data"), description=(
        "Where all state lives: the SQLite database (unless database_url is set), checkpoints, the URL "
        "signing secret, spilled adapters and converted models."))
    host: str = Field("127.0.0.1", description="Interface the HTTP server binds to.")
    port: int = Field(8000, ge=1, le=65535, description="Port the HTTP server listens on.")
    base_models: Annotated[list[str], NoDecode] = Field(default_factory=lambda: list(DEFAULT_BASE_MODELS),
        description=("Served base models as NAME=SOURCE (comma-separated or a JSON list). SOURCE is a local "
                     "directory, hf://org/name[@rev], ms://org/name, gguf://file.gguf or a built-in alias."))
    database_url: str | None = Field(None, description=(
        "SQLAlchemy URL of the control-plane database (postgresql://... in production); default: SQLite "
        "file under data_dir."))
    database_pool_size: int = Field(24, ge=1, le=1000, description=(
        "Database connections each process keeps open once used (8 more open for a burst and close again); "
        "at least the gateway's blocking threads plus its scheduler loops, or transactions queue for a "
        "connection and bursts pay for new ones. On PostgreSQL mind max_connections across processes."))
    group_commit: bool | None = Field(None, description=(
        "Run the submissions' write transactions of many tenants as one transaction on one writer thread, each "
        "in its own savepoint (one commit per group instead of one per request). Default: on for SQLite, "
        "where one writer runs at a time anyway; off for PostgreSQL."))
    cache_dir: Path | None = Field(None, description=(
        "Where downloaded and converted base models are cached; default: <data_dir>/models."))
    device: str | None = Field(None, description="Torch device for the base models (cpu, cuda, cuda:1); "
                               "default: cuda when available, else cpu.")
    dtype: str | None = Field(None, description="Torch dtype of the base weights (float32, bfloat16, "
                              "float16); default: chosen for the device.")
    max_tokens_per_pass: int = Field(8192, ge=1, description=(
        "Tokens in one packed forward/backward micro-batch on a worker; one datum may not exceed it."))
    micro_batch_tokens: int | None = Field(None, ge=1, description=(
        "Tokens per packed pass when a step holds more (capped by max_tokens_per_pass); default: 512 on CPU, "
        "where bigger passes ran slower per token, and max_tokens_per_pass on a GPU."))
    keep_freed_host_memory: bool = Field(True, description=(
        "CPU workers: keep freed memory in the process for the next pass (glibc mallopt) instead of paging it "
        "in afresh every pass; the process then holds its peak heap."))
    max_tokens_per_step: int = Field(32768, ge=1, description=(
        "Tokens the scheduler packs into one step (several micro-batches); a forward_backward request "
        "larger than this is refused."))
    max_adapters_per_pass: int = Field(64, ge=1, description=(
        "Distinct adapters (models) in one packed step; never more than max_resident_adapters."))
    max_resident_adapters: int = Field(64, ge=1, description=(
        "Adapters kept on the device per base model; idle ones beyond this are spilled to host memory."))
    max_lora_rank: int = Field(256, ge=1, description="Largest LoRA rank a tenant may ask for.")
    long_poll_seconds: float = Field(25.0, gt=0, lt=40, description=(
        "Longest a retrieve_future call is held open before answering try_again (the SDK times out at 45)."))
    answered_result_seconds: float = Field(DEFAULT_ANSWERED_KEEP_S, ge=0, description=(
        "How long a result stays in the result store after it was answered to its owner (a retry of a lost "
        "response; 0: dropped at once). Results nobody retrieved yet stay an hour. The SDK fetches each "
        "result once, so this bounds the store's memory: results per second x this many seconds."))
    batch_window_ms: float = Field(5.0, ge=0, description=(
        "How long the scheduler waits after work arrives for more, so tenants' requests share a pass or sample "
        "batch; not for barriers alone (optim_step, saves, loads), nor while the scheduler holds for tenants "
        "it expects back."))
    batch_window_adaptive: bool = Field(True, description=(
        "Apply the batch window only while requests of two or more tenants arrived within the last second; "
        "a tenant training alone is planned at once. False: always wait the window."))
    default_max_models_per_tenant: int | None = Field(None, ge=1, description=(
        "Models per tenant when the tenant has no max_models quota of its own; unset: unlimited."))
    default_tokens_per_minute: int | None = Field(None, ge=1, description=(
        "Tokens a tenant may submit per minute (forward/backward tokens; prompt + max_tokens x num_samples "
        "for sampling) when it has no tokens_per_minute quota of its own; unset: unlimited."))
    default_max_concurrent_requests: int | None = Field(None, ge=1, description=(
        "Unfinished (queued or running) requests per tenant when it has no max_concurrent_requests quota of "
        "its own; unset: unlimited."))
    quota_window_seconds: float = Field(60.0, gt=0, description=(
        "Window of the tokens_per_minute quota: a tenant's token bucket refills its full limit over this "
        "long. Keep 60 (per minute); tests shorten it."))
    saturation_queue_depth: int | None = Field(256, ge=1, description=(
        "Requests queued for one base model from which pending futures report queue_state "
        "paused_capacity (the SDK logs it); unset: never by depth."))
    saturation_wait_seconds: float | None = Field(30.0, gt=0, description=(
        "A request still queued (not running) after this long reports queue_state paused_capacity; unset: "
        "never by wait."))
    pass_latency_factor: float = Field(DEFAULT_PASS_LATENCY_FACTOR, ge=0, description=(
        "While two or more tenants train, keep each packed pass about this many times as long as the smallest "
        "tenant's queued work would take alone (pass time is fitted as fixed + per-token cost from the passes "
        "run), which bounds a light tenant's wait beside a heavy one. Where a pass costs mostly a fixed amount "
        "(a GPU) passes stay large; where it costs per token (a CPU) they shrink. A tenant alone keeps full "
        "passes. 0: off, passes fill max_tokens_per_step (most packing, best throughput)."))
    max_pass_ms: float | None = Field(None, gt=0, description=(
        "An explicit pass-duration target while two or more tenants train, instead of pass_latency_factor "
        "(the token budget follows the fitted pass cost; one request always fits). Unset: "
        "pass_latency_factor decides."))
    hold_factor: float = Field(4.0, ge=0, description=(
        "Hold a packed pass (or sample batch) for active tenants whose next request is predicted to arrive "
        "soon (from each client's turnaround), at most this many times the item's fixed cost, so that "
        "independent closed-loop clients come to share passes. Never for a tenant alone. 0: off."))
    max_hold_ms: float = Field(250.0, ge=0, description=(
        "The longest a pass or sample batch is held for tenants expected soon, whatever its fixed cost."))
    default_max_checkpoints: int | None = Field(None, ge=1, description=(
        "Checkpoints a tenant may store when it has no max_checkpoints quota of its own (a named save over it "
        "is a 400); unset: unlimited. Cluster mode: 1000."))
    default_max_checkpoint_bytes: int | None = Field(None, ge=1, description=(
        "Bytes of stored checkpoints per tenant when it has no max_checkpoint_bytes quota of its own (a named "
        "save once it is reached is a 400); unset: unlimited. Cluster mode: 100 GiB."))
    default_max_sessions: int | None = Field(None, ge=1, description=(
        "Unfinished sessions per tenant when it has no max_sessions quota of its own (429 over it); unset: "
        "unlimited. Cluster mode: 200."))
    default_max_sampling_sessions: int | None = Field(None, ge=1, description=(
        "Sampling sessions (of unfinished sessions) per tenant when it has no max_sampling_sessions quota of its "
        "own (429 over it); unset: unlimited. Cluster mode: 2000."))
    sweep_interval_seconds: float = Field(60.0, gt=0, description=(
        "How often the sweeper deletes expired checkpoints (rows and files) and finishes stale sessions."))
    stale_session_seconds: float = Field(3600.0, gt=0, description=(
        "A session without a heartbeat for this long is finished by the sweeper (the SDK beats every 10 s)."))
    download_url_ttl_seconds: int = Field(3600, ge=60, le=7 * 24 * 3600, description=(
        "Lifetime of signed download URLs (at most 7 days)."))
    storage_url: str | None = Field(None, description=(
        "Where checkpoints live: s3://bucket/prefix for S3-compatible storage (credentials from the standard "
        "AWS chain: env, shared config, web identity); unset: <data_dir>/checkpoints on local disk."))
    s3_endpoint_url: str | None = Field(None, description=(
        "Endpoint of an S3-compatible server (MinIO, Ceph, R2), e.g. http://minio:9000; unset: AWS S3."))
    s3_cache_dir: Path | None = Field(None, description=(
        "Local read-through cache of S3 checkpoints on each node; default: <data_dir>/s3-cache."))
    s3_cache_max_bytes: int = Field(10 << 30, ge=0, description=(
        "Bytes the S3 checkpoint cache may hold per node; least recently used checkpoints are evicted."))
    s3_multipart_threshold_bytes: int = Field(64 << 20, ge=5 << 20, description=(
        "Checkpoint files at least this large are uploaded and downloaded in parts of this size."))
    s3_timeout_seconds: float = Field(30.0, gt=0, description=(
        "Connect and read timeout of each S3 call (3 attempts); a save fails with a server error after it."))
    s3_incomplete_upload_age_seconds: float = Field(3600.0, gt=0, description=(
        "The sweeper removes objects of S3 checkpoints that never got their manifest (a killed upload) once "
        "they are this old; keep it above the longest save."))
    s3_incomplete_sweep_interval_seconds: float = Field(600.0, gt=0, description=(
        "Least time between two sweeps for incomplete S3 uploads (each lists the bucket prefix)."))
    secret_key: SecretStr | None = Field(None, description=(
        "Server key that encrypts tenants' hub tokens at rest (any string, 32+ characters). Required in "
        "cluster mode; unset in `carpool serve`: generated once under <data_dir>/secrets."))
    hub_token_huggingface: SecretStr | None = Field(None, description=(
        "Operator-wide Hugging Face token used for hub pushes of tenants that stored none."))
    hub_token_modelscope: SecretStr | None = Field(None, description=(
        "Operator-wide ModelScope token used for hub pushes of tenants that stored none."))
    hub_timeout_seconds: float = Field(60.0, gt=0, description=(
        "Timeout of each call a hub push makes to the Hugging Face Hub or ModelScope."))
    hub_push_max_retries: int = Field(4, ge=0, description=(
        "Retries of a hub push after a transient failure (connection error, 5xx, 429), with exponential "
        "backoff; none after 401/403/404."))
    log_level: str = Field("INFO", description="Root log level (DEBUG, INFO, WARNING, ...).")
    http_keep_alive_seconds: int = Field(75, gt=0, description=(
        "How long an idle client connection stays open. Above the SDK's 10 s heartbeat period, so each client "
        "keeps its connections instead of reconnecting between heartbeats (uvicorn's own default is 5 s)."))
    access_log: bool = Field(False, description=(
        "Log one line per HTTP request (uvicorn's access log). Off by default: every request is already "
        "counted in /metrics (route, status, latency) and every training/sampling request is in the request "
        "log with its status and timings, while a line per long-poll costs about a tenth of the gateway's "
        "CPU per request (docs/performance.md)."))
    metrics_per_tenant: bool = Field(False, description=(
        "Export per-tenant series (carpool_tenant_*: tokens trained/sampled, requests) at /metrics. Off by "
        "default: the tenant label's cardinality grows with the number of tenants."))

    @field_validator("base_models", mode="before")
    @classmethod
    def _split_base_models(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @field_validator("base_models")
    @classmethod
    def _check_base_models(cls, value: list[str]) -> list[str]:
        specs = [parse_base_model(v) for v in value]
        if not specs:
            raise ValueError("at least one base model must be served")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"base model names must be unique, got {names}")
        return value

    # -- derived ----------------------------------------------------------------------------------
    def served_base_models(self) -> list[BaseModelSpec]:
        return [parse_base_model(v) for v in self.base_models]

    def resolved_database_url(self) -> str:
        if self.database_url:
            return normalize_database_url(self.database_url)
        return database_url_for_data_dir(self.data_dir)

    @property
    def checkpoints_dir(self) -> Path:
        return self.data_dir / "checkpoints"

    @property
    def signing_secret_path(self) -> Path:
        return self.data_dir / "secrets" / "url-signing.key"

    @property
    def spill_dir(self) -> Path:
        return self.data_dir / "spill"

    @property
    def scratch_dir(self) -> Path:
        return self.data_dir / "scratch"

    @property
    def models_dir(self) -> Path:
        return self.cache_dir or self.data_dir / "models"

    @property
    def resolved_s3_cache_dir(self) -> Path:
        return self.s3_cache_dir or self.data_dir / "s3-cache"

    @property
    def hub_secret_path(self) -> Path:
        return self.data_dir / "secrets" / "hub-tokens.key"


class ClusterSettings(ServiceSettings):
    """Settings of the cluster processes (`carpool serve --mode cluster`, `scheduler`, `worker`, `cluster up`).

    Everything of `ServiceSettings` applies (limits, data dir for checkpoints); `database_url` must point at
    PostgreSQL shared by every process, and the data dir (checkpoints, snapshots) must be shared storage.
    """

    redis_url: str = Field("redis://127.0.0.1:6379/0", description=(
        "Redis of the queue, results, wake-ups, replica membership and the durability log. Production Redis "
        "must persist with AOF (appendonly yes, appendfsync always to lose nothing acknowledged)."))
    redis_prefix: str = Field("carpool", description="Prefix of every Redis key (several clusters may share "
                              "one Redis under different prefixes).")
    cluster_config: Path | None = Field(None, description=(
        "TOML file describing worker deployments per base model (replicas, num_cpus, num_gpus); see "
        "deploy/cluster.toml. Unset: every base model of base_models with `replicas` replicas."))
    replicas: int = Field(1, ge=1, description="Worker replicas per base model (when no cluster_config).")
    replica_num_cpus: float = Field(0.5, ge=0, description="CPUs Ray reserves per worker replica.")
    replica_num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves per worker replica.")
    ray_address: str | None = Field(None, description=(
        "Ray cluster to join (`auto`, or ray://host:10001); unset: `cluster up` starts a local Ray."))
    ray_num_cpus: int | None = Field(None, ge=1, description="CPUs of the local Ray `cluster up` starts.")
    heartbeat_ttl_seconds: float = Field(5.0, gt=0, description=(
        "A replica whose heartbeat is this old is suspected; after as long again it is declared dead and its "
        "adapters are restored on other replicas."))
    snapshot_every_steps: int = Field(5, ge=1, description=(
        "Optimizer steps per adapter between durability snapshots (weights + optimizer state); the request "
        "log replayed after a replica failure holds at most this many steps."))
    snapshot_dir: Path | None = Field(None, description=(
        "Shared directory of adapter snapshots; default: <data_dir>/snapshots."))
    scheduler_lease_seconds: float = Field(10.0, gt=0, description=(
        "TTL of the per-base-model scheduler lease; a standby takes over this long after the active one died."))
    model_info_wait_seconds: float = Field(600.0, gt=0, description=(
        "How long a cluster gateway waits at start-up for the workers to publish their base models."))
    replica_wait_seconds: float = Field(300.0, gt=0, description=(
        "How long a scheduler waits for a live replica before failing a request."))
    allow_insecure_redis: bool = Field(False, description=(
        "Start cluster processes against a Redis URL with neither a password nor TLS (rediss://). Only for "
        "development: whoever reaches such a Redis controls the queue, results and workers."))
    # Finite per-tenant defaults in cluster mode (a shared service): a tenant's own quota still wins.
    default_max_models_per_tenant: int | None = Field(64, ge=1, description=(
        "Models per tenant when the tenant has no max_models quota of its own (cluster mode default: 64)."))
    default_max_concurrent_requests: int | None = Field(1024, ge=1, description=(
        "Unfinished requests per tenant without a max_concurrent_requests quota (cluster mode default: 1024)."))
    default_max_checkpoints: int | None = Field(1000, ge=1, description=(
        "Checkpoints per tenant without a max_checkpoints quota (cluster mode default: 1000)."))
    default_max_checkpoint_bytes: int | None = Field(100 * 1024**3, ge=1, description=(
        "Checkpoint bytes per tenant without a max_checkpoint_bytes quota (cluster mode default: 100 GiB)."))
    default_max_sessions: int | None = Field(200, ge=1, description=(
        "Unfinished sessions per tenant without a max_sessions quota (cluster mode default: 200)."))
    default_max_sampling_sessions: int | None = Field(2000, ge=1, description=(
        "Sampling sessions per tenant without a max_sampling_sessions quota (cluster mode default: 2000)."))
    hub_broker_url: str | None = Field(None, description=(
        "Celery broker of hub pushes (`carpool hub-worker` consumes it); default: redis_url."))
    hub_heartbeat_file: Path | None = Field(None, description=(
        "File the hub worker touches every 10 s while it runs, pushing or idle (its Kubernetes liveness "
        "probe checks the file's age; `celery inspect ping` would time out while a push holds the slot); "
        "unset: none."))
    metrics_port: int | None = Field(None, ge=0, le=65535, description=(
        "Port of the Prometheus /metrics endpoint of a scheduler (`carpool scheduler`) or hub worker, which "
        "serve no other HTTP; unset: none. Gateways serve /metrics on their own port."))
    scheduler_processes: bool = Field(False, description=(
        "`cluster up` only: run each base model's scheduler as a `carpool scheduler` child process, as a "
        "production deployment does, instead of a thread of the gateway's process. The scheduler then has a "
        "GIL of its own (with hundreds of clients the gateway's threads starved it). Its pass counters still reach "
        "the gateway's /metrics through Redis; its own series (queue waits, reloads) are on scheduler_metrics_port."))
    scheduler_metrics_port: int | None = Field(None, ge=0, le=65535, description=(
        "With scheduler_processes: port of the first scheduler child's /metrics (the next base model's on the "
        "next port); unset: none."))

    @property
    def resolved_snapshot_dir(self) -> Path:
        return self.snapshot_dir or self.data_dir / "snapshots"
