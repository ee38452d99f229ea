"""SQLAlchemy models of Carpool's control-plane state: tenants, keys, sessions, runs, requests, checkpoints.

Payloads (tensors, token batches, weights) never live here: rows hold metadata and pointers
(`storage_uri`) only. Every tenant-owned row carries `tenant_id` so that any lookup can be scoped to the
caller's tenant. The schema itself is created and changed only by the Alembic migrations in `migrations/`;
this metadata is the autogenerate target and must stay in sync with them (a test compares the two).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from services.db.columns import JSON_DOCUMENT, UtcDateTime, utcnow
from services.db.ids import (
    ApiKeyId,
    CheckpointRowId,
    HubPushId,
    ModelId,
    RequestId,
    SamplingSessionId,
    SessionId,
    TenantId,
)

RequestStatus = Literal["queued", "running", "done", "failed"]
REQUEST_STATUSES: tuple[RequestStatus, ...] = ("queued", "running", "done", "failed")
CheckpointKind = Literal["training", "sampler", "external"]
CHECKPOINT_KINDS: tuple[CheckpointKind, ...] = ("training", "sampler", "external")
TrainingRunStatus = Literal["active", "unloaded", "corrupted"]
HubTarget = Literal["hf", "ms"]
HUB_TARGETS: tuple[HubTarget, ...] = ("hf", "ms")
HubPushStatus = Literal["queued", "running", "done", "failed"]
HUB_PUSH_STATUSES: tuple[HubPushStatus, ...] = ("queued", "running", "done", "failed")

# Deterministic constraint names: Alembic needs them to drop/alter constraints later, and SQLite batch
# migrations cannot address unnamed ones at all.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ID_LENGTH = 128
"""Room for composite ids such as `sess-<24 hex>:sample:<n>`."""


def _one_of(column: str, values: tuple[str, ...]) -> CheckConstraint:
    allowed = ", ".join(f"'{v}'" for v in values)
    return CheckConstraint(f"{column} IN ({allowed})", name=f"{column}_valid")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class TenantRow(Base):
    """A customer account. Quotas are per tenant; NULL means "no tenant-specific limit"."""

    __tablename__ = "tenants"

    id: Mapped[TenantId] = mapped_column(String(ID_LENGTH), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    max_models: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer)
    max_checkpoints: Mapped[int | None] = mapped_column(Integer)
    max_checkpoint_bytes: Mapped[int | None] = mapped_column(BigInteger)
    max_sessions: Mapped[int | None] = mapped_column(Integer)
    max_sampling_sessions: Mapped[int | None] = mapped_column(Integer)


class ApiKeyRow(Base):
    """An API key, stored only as a hash; `prefix` is the non-secret head shown in listings."""

    __tablename__ = "api_keys"

    id: Mapped[ApiKeyId] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[TenantId] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(32), index=True)
    key_hash: Mapped[str] = mapped_column(String(128), unique=True)
    label: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    last_used_at: Mapped[datetime | None] = mapped_column(UtcDateTime)


class SessionRow(Base):
    """A Tinker client session: parent of training runs and sampling sessions, kept alive by heartbeats."""

    __tablename__ = "sessions"

    id: Mapped[SessionId] = mapped_column(String(ID_LENGTH), primary_key=True)
    tenant_id: Mapped[TenantId] = mapped_column(ForeignKey("tenants.id"), index=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    last_heartbeat_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    tags: Mapped[list[str]] = mapped_column(JSON_DOCUMENT, default=list)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSON_DOCUMENT, default=dict)
    sdk_version: Mapped[str | None] = mapped_column(String(64))
    project_id: Mapped[str | None] = mapped_column(String(200))
    display_name: Mapped[str | None] = mapped_column(String(200))
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime)


class TrainingRunRow(Base):
    """A LoRA adapter being trained (Tinker's "model"); `next_seq_id` orders the client's requests on it."""

    __tablename__ = "training_runs"

    id: Mapped[ModelId] = mapped_column(String(ID_LENGTH), primary_key=True)
    tenant_id: Mapped[TenantId] = mapped_column(ForeignKey("tenants.id"), index=True)
    session_id: Mapped[SessionId] = mapped_column(ForeignKey("sessions.id"), index=True)
    base_model: Mapped[str] = mapped_column(String(200))
    lora_rank: Mapped[int] = mapped_column(Integer)
    lora_config: Mapped[dict[str, Any]] = mapped_column(JSON_DOCUMENT, default=dict)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSON_DOCUMENT, default=dict)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    last_request_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    next_seq_id: Mapped[int] = mapped_column(BigInteger, default=0)
    status: Mapped[TrainingRunStatus] = mapped_column(String(16), default="active")


class SamplingSessionRow(Base):
    """A sampler bound to a base model, optionally with LoRA weights loaded from `model_path`."""

    __tablename__ = "sampling_sessions"

    id: Mapped[SamplingSessionId] = mapped_column(String(ID_LENGTH), primary_key=True)
    tenant_id: Mapped[TenantId] = mapped_column(ForeignKey("tenants.id"), index=True)
    session_id: Mapped[SessionId] = mapped_column(ForeignKey("sessions.id"), index=True)
    base_model: Mapped[str] = mapped_column(String(200))
    model_path: Mapped[str | None] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    joined_clients: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Clients that joined this session (`join_sampling_session`); the next joiner gets this + 1."""


class RequestRow(Base):
    """One API call's lifecycle (queued → running → done|failed). Metadata only, never the payload."""

    __tablename__ = "requests"
    # NULLs are distinct in a UNIQUE constraint on both PostgreSQL and SQLite, so this only binds rows
    # that have both a model and a seq id: exactly "a seq id is used once per training run".
    __table_args__ = (
        UniqueConstraint("model_id", "seq_id"),
        Index(None, "tenant_id", "created_at"),
        Index(None, "sampling_session_id", "finished_at"),  # retrieve_futures: a session's completions
        _one_of("status", REQUEST_STATUSES),
    )

    id: Mapped[RequestId] = mapped_column(String(ID_LENGTH), primary_key=True)
    tenant_id: Mapped[TenantId] = mapped_column(ForeignKey("tenants.id"))
    model_id: Mapped[ModelId | None] = mapped_column(ForeignKey("training_runs.id"))
    sampling_session_id: Mapped[SamplingSessionId | None] = mapped_column(
        ForeignKey("sampling_sessions.id"), index=True
    )
    kind: Mapped[str] = mapped_column(String(32))
    seq_id: Mapped[int | None] = mapped_column(BigInteger)
    status: Mapped[RequestStatus] = mapped_column(String(16), default="queued", index=True)
    error: Mapped[str | None] = mapped_column(Text)
    category: Mapped[str | None] = mapped_column(String(16))
    """Tinker's `RequestErrorCategory` (unknown/server/user) when failed."""
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    num_tokens: Mapped[int | None] = mapped_column(Integer)
    pass_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), index=True)
    """The packed pass that served this request, to join request logs with pass metrics."""
    loss: Mapped[float | None] = mapped_column(Float)
    """A forward(/backward)'s `loss:sum`, for the dashboard's loss curves (metadata, not payload)."""
    record_stability: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """A sample request sent with `record_stability_info`: `stable_reinforce` may read its logprobs."""


class CheckpointRow(Base):
    """Saved adapter weights. `checkpoint_id` is Tinker's `weights/<name>` or `sampler_weights/<name>`."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("training_run_id", "checkpoint_id"),
        _one_of("kind", CHECKPOINT_KINDS),
    )

    id: Mapped[CheckpointRowId] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[TenantId] = mapped_column(ForeignKey("tenants.id"), index=True)
    training_run_id: Mapped[ModelId] = mapped_column(ForeignKey("training_runs.id"))
    checkpoint_id: Mapped[str] = mapped_column(String(256))
    kind: Mapped[CheckpointKind] = mapped_column(String(16))
    tinker_path: Mapped[str] = mapped_column(String(512), unique=True)
    storage_uri: Mapped[str] = mapped_column(String(1024))
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime, index=True)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSON_DOCUMENT, default=dict)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)


class UsageRow(Base):
    """Per-tenant usage aggregated into hourly buckets: one row per (tenant, hour, kind), upserted."""

    __tablename__ = "usage"

    tenant_id: Mapped[TenantId] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    bucket_start: Mapped[datetime] = mapped_column(UtcDateTime, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), primary_key=True)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    requests: Mapped[int] = mapped_column(Integer, default=0)


class HubPushRow(Base):
    """An export of a checkpoint to Hugging Face (`hf`) or ModelScope (`ms`), run asynchronously."""

    __tablename__ = "hub_pushes"
    __table_args__ = (_one_of("target", HUB_TARGETS), _one_of("status", HUB_PUSH_STATUSES))

    id: Mapped[HubPushId] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[TenantId] = mapped_column(ForeignKey("tenants.id"), index=True)
    # SET NULL: deleting a checkpoint must not erase the record that it was once published.
    checkpoint_id: Mapped[CheckpointRowId | None] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="SET NULL"), index=True
    )
    tinker_path: Mapped[str] = mapped_column(String(512))
    """Copied from the checkpoint so the push stays readable after the checkpoint is deleted."""
    target: Mapped[HubTarget] = mapped_column(String(8))
    repo: Mapped[str] = mapped_column(String(256))
    private: Mapped[bool] = mapped_column(Boolean, default=True)
    status: Mapped[HubPushStatus] = mapped_column(String(16), default="queued")
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    # Issue 11 (migration 0004): what to push to, and what the hub answered.
    revision: Mapped[str | None] = mapped_column(String(256))
    """The branch to commit to (None: the repo's default branch)."""
    commit_message: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    started_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    hub_revision: Mapped[str | None] = mapped_column(String(128))
    """The commit the push created (or found already there, on a retry)."""
    url: Mapped[str | None] = mapped_column(String(512))


class HubCredentialRow(Base):
    """A tenant's token for one hub, encrypted with the server key (never returned, never logged)."""

    __tablename__ = "hub_credentials"
    __table_args__ = (UniqueConstraint("tenant_id", "target"), _one_of("target", HUB_TARGETS))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[TenantId] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    target: Mapped[HubTarget] = mapped_column(String(8))
    token_ciphertext: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)


class AuditLogRow(Base):
    """One operator action (key created/revoked, quota changed, tenant disabled, ...), CLI and dashboard alike.

    Append-only. `actor_*` name who acted (NULL tenant: the CLI, run with database access rather than a
    key); `tenant_id` is the tenant affected, kept without a foreign key so the record outlives the tenant.
    """

    __tablename__ = "audit_log"
    __table_args__ = (Index(None, "tenant_id", "id"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    actor_tenant_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    actor_key_prefix: Mapped[str | None] = mapped_column(String(32))
    action: Mapped[str] = mapped_column(String(64))
    target_type: Mapped[str] = mapped_column(String(32))
    target_id: Mapped[str] = mapped_column(String(256))
    tenant_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON_DOCUMENT)


class AdminSessionRow(Base):
    """A dashboard login: opaque and server-side, so logging out or revoking its key ends it at once.

    `id` is the SHA-256 of the cookie's token (a leaked table grants no session); the session is bound to
    the API key that created it (revoking the key ends the session, deleting it removes the row).
    """

    __tablename__ = "admin_sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key_id: Mapped[ApiKeyId] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    tenant_id: Mapped[TenantId] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    csrf_token: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime)


# Indexes for the operators' dashboard (migration 0005): its cross-tenant pages list newest first, and
# without these each page is a sort of the whole table (seconds at a few hundred thousand requests).
Index("ix_requests_created_at", RequestRow.created_at)
Index("ix_training_runs_created_at", TrainingRunRow.created_at)
Index("ix_checkpoints_created_at", CheckpointRow.created_at)
Index("ix_usage_bucket_start", UsageRow.bucket_start)


class CustomLossRow(Base):
    """A server-side custom loss (`create_custom_loss`): the checked graph as data, owned by one session."""

    __tablename__ = "custom_losses"
    __table_args__ = (UniqueConstraint("session_id", "seq"),)

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    tenant_id: Mapped[TenantId] = mapped_column(ForeignKey("tenants.id"), index=True)
    session_id: Mapped[SessionId] = mapped_column(ForeignKey("sessions.id"))
    seq: Mapped[int] = mapped_column(Integer)
    """The SDK's `custom_loss_seq_id` (a retry repeats it)."""
    name: Mapped[str] = mapped_column(String(200))
    program: Mapped[dict[str, Any]] = mapped_column(JSON_DOCUMENT)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
