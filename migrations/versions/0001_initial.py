"""Initial schema.

Tables: tenants, api_keys, sessions, training_runs, sampling_sessions, requests, checkpoints, usage
(hourly buckets) and hub_pushes.

Written out explicitly (types included) rather than importing `services.db.models`: a migration is a frozen
record of the schema at this revision and must not change when the models do.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = 128


def _id(name: str = "id") -> sa.Column[str]:
    return sa.Column(name, sa.String(length=ID), nullable=False)


def _ref(name: str, nullable: bool = False) -> sa.Column[str]:
    return sa.Column(name, sa.String(length=ID), nullable=nullable)


def _fk(table: str, column: str, target: str, ondelete: str | None = None) -> sa.ForeignKeyConstraint:
    """A foreign key named like the models' naming convention (`fk_<table>_<column>_<referred table>`)."""
    referred_table = target.split(".")[0]
    name = op.f(f"fk_{table}_{column}_{referred_table}")
    return sa.ForeignKeyConstraint([column], [target], name=name, ondelete=ondelete)


def _utc(name: str, nullable: bool = False) -> sa.Column[Any]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _json(name: str) -> sa.Column[Any]:
    return sa.Column(name, sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=False)


def _one_of(table: str, column: str, values: Sequence[str]) -> sa.CheckConstraint:
    allowed = ", ".join(f"'{v}'" for v in values)
    return sa.CheckConstraint(f"{column} IN ({allowed})", name=op.f(f"ck_{table}_{column}_valid"))


def upgrade() -> None:
    op.create_table(
        "tenants",
        _id(),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("is_admin", sa.Boolean(), nullable=False),
        sa.Column("disabled", sa.Boolean(), nullable=False),
        _utc("created_at"),
        sa.Column("max_models", sa.Integer(), nullable=True),
        sa.Column("tokens_per_minute", sa.Integer(), nullable=True),
        sa.Column("max_concurrent_requests", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        _ref("tenant_id"),
        sa.Column("prefix", sa.String(length=32), nullable=False),
        sa.Column("key_hash", sa.String(length=128), nullable=False),
        sa.Column("label", sa.String(length=200), nullable=True),
        _utc("created_at"),
        _utc("revoked_at", nullable=True),
        _utc("last_used_at", nullable=True),
        _fk("api_keys", "tenant_id", "tenants.id", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_prefix"), "api_keys", ["prefix"])
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])

    op.create_table(
        "sessions",
        _id(),
        _ref("tenant_id"),
        _utc("created_at"),
        _utc("last_heartbeat_at"),
        _json("tags"),
        _json("user_metadata"),
        sa.Column("sdk_version", sa.String(length=64), nullable=True),
        sa.Column("project_id", sa.String(length=200), nullable=True),
        sa.Column("display_name", sa.String(length=200), nullable=True),
        _utc("finished_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sessions")),
        _fk("sessions", "tenant_id", "tenants.id"),
    )
    op.create_index(op.f("ix_sessions_tenant_id"), "sessions", ["tenant_id"])

    op.create_table(
        "usage",
        _ref("tenant_id"),
        _utc("bucket_start"),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "bucket_start", "kind", name=op.f("pk_usage")),
        _fk("usage", "tenant_id", "tenants.id"),
    )

    op.create_table(
        "training_runs",
        _id(),
        _ref("tenant_id"),
        _ref("session_id"),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        sa.Column("lora_rank", sa.Integer(), nullable=False),
        _json("lora_config"),
        _json("user_metadata"),
        _utc("created_at"),
        _utc("last_request_at", nullable=True),
        sa.Column("next_seq_id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_training_runs")),
        _fk("training_runs", "tenant_id", "tenants.id"),
        _fk("training_runs", "session_id", "sessions.id"),
    )
    op.create_index(op.f("ix_training_runs_session_id"), "training_runs", ["session_id"])
    op.create_index(op.f("ix_training_runs_tenant_id"), "training_runs", ["tenant_id"])

    op.create_table(
        "sampling_sessions",
        _id(),
        _ref("tenant_id"),
        _ref("session_id"),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        sa.Column("model_path", sa.String(length=512), nullable=True),
        _utc("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sampling_sessions")),
        _fk("sampling_sessions", "tenant_id", "tenants.id"),
        _fk("sampling_sessions", "session_id", "sessions.id"),
    )
    op.create_index(op.f("ix_sampling_sessions_session_id"), "sampling_sessions", ["session_id"])
    op.create_index(op.f("ix_sampling_sessions_tenant_id"), "sampling_sessions", ["tenant_id"])

    op.create_table(
        "requests",
        _id(),
        _ref("tenant_id"),
        _ref("model_id", nullable=True),
        _ref("sampling_session_id", nullable=True),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("seq_id", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("category", sa.String(length=16), nullable=True),
        _utc("created_at"),
        _utc("started_at", nullable=True),
        _utc("finished_at", nullable=True),
        sa.Column("num_tokens", sa.Integer(), nullable=True),
        sa.Column("pass_id", sa.String(length=ID), nullable=True),
        _one_of("requests", "status", ("queued", "running", "done", "failed")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_requests")),
        # NULLs are distinct in UNIQUE on both backends: only (model, seq) pairs that are both set collide.
        sa.UniqueConstraint("model_id", "seq_id", name=op.f("uq_requests_model_id_seq_id")),
        _fk("requests", "tenant_id", "tenants.id"),
        _fk("requests", "model_id", "training_runs.id"),
        _fk("requests", "sampling_session_id", "sampling_sessions.id"),
    )
    op.create_index(op.f("ix_requests_pass_id"), "requests", ["pass_id"])
    op.create_index(op.f("ix_requests_sampling_session_id"), "requests", ["sampling_session_id"])
    op.create_index(op.f("ix_requests_status"), "requests", ["status"])
    op.create_index(op.f("ix_requests_tenant_id_created_at"), "requests", ["tenant_id", "created_at"])

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        _ref("tenant_id"),
        _ref("training_run_id"),
        sa.Column("checkpoint_id", sa.String(length=256), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("tinker_path", sa.String(length=512), nullable=False),
        sa.Column("storage_uri", sa.String(length=1024), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("public", sa.Boolean(), nullable=False),
        _utc("expires_at", nullable=True),
        _json("user_metadata"),
        _utc("created_at"),
        _one_of("checkpoints", "kind", ("training", "sampler", "external")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("tinker_path", name=op.f("uq_checkpoints_tinker_path")),
        sa.UniqueConstraint(
            "training_run_id", "checkpoint_id", name=op.f("uq_checkpoints_training_run_id_checkpoint_id")
        ),
        _fk("checkpoints", "tenant_id", "tenants.id"),
        _fk("checkpoints", "training_run_id", "training_runs.id"),
    )
    op.create_index(op.f("ix_checkpoints_expires_at"), "checkpoints", ["expires_at"])
    op.create_index(op.f("ix_checkpoints_tenant_id"), "checkpoints", ["tenant_id"])

    op.create_table(
        "hub_pushes",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        _ref("tenant_id"),
        sa.Column("checkpoint_id", sa.Integer(), nullable=True),
        sa.Column("tinker_path", sa.String(length=512), nullable=False),
        sa.Column("target", sa.String(length=8), nullable=False),
        sa.Column("repo", sa.String(length=256), nullable=False),
        sa.Column("private", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        _utc("created_at"),
        _utc("finished_at", nullable=True),
        _one_of("hub_pushes", "target", ("hf", "ms")),
        _one_of("hub_pushes", "status", ("queued", "running", "done", "failed")),
        # SET NULL: deleting a checkpoint keeps the record that it was once published.
        _fk("hub_pushes", "checkpoint_id", "checkpoints.id", ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hub_pushes")),
        _fk("hub_pushes", "tenant_id", "tenants.id"),
    )
    op.create_index(op.f("ix_hub_pushes_checkpoint_id"), "hub_pushes", ["checkpoint_id"])
    op.create_index(op.f("ix_hub_pushes_tenant_id"), "hub_pushes", ["tenant_id"])


def downgrade() -> None:
    # Children before parents; dropping a table drops its indexes with it.
    for table in (
        "hub_pushes",
        "checkpoints",
        "requests",
        "sampling_sessions",
        "training_runs",
        "usage",
        "sessions",
        "api_keys",
        "tenants",
    ):
        op.drop_table(table)
