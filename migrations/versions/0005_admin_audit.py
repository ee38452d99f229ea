"""Operators' view: the audit log, dashboard sessions, and the indexes the dashboard's listings need.

- `audit_log`: append-only record of operator actions (CLI and dashboard); no foreign keys, so a record
  outlives the tenant or key it names.
- `admin_sessions`: server-side dashboard logins, bound to the API key that created them.
- `requests.loss`: a forward(/backward)'s `loss:sum`, for the dashboard's loss curves.
- Indexes on `requests.created_at`, `training_runs.created_at`, `checkpoints.created_at` and
  `usage.bucket_start`: the dashboard lists these across tenants, newest first.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = 128

_INDEXES = (
    ("requests", "created_at"),
    ("training_runs", "created_at"),
    ("checkpoints", "created_at"),
    ("usage", "bucket_start"),
)


def _utc(name: str, nullable: bool = False) -> sa.Column[Any]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True,
                  nullable=False),
        _utc("created_at"),
        sa.Column("actor_tenant_id", sa.String(length=ID), nullable=True),
        sa.Column("actor_key_prefix", sa.String(length=32), nullable=True),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target_type", sa.String(length=32), nullable=False),
        sa.Column("target_id", sa.String(length=256), nullable=False),
        sa.Column("tenant_id", sa.String(length=ID), nullable=True),
        sa.Column("detail", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    op.create_index(op.f("ix_audit_log_tenant_id_id"), "audit_log", ["tenant_id", "id"])

    op.create_table(
        "admin_sessions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(length=ID), nullable=False),
        sa.Column("csrf_token", sa.String(length=64), nullable=False),
        _utc("created_at"),
        _utc("expires_at"),
        _utc("revoked_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_admin_sessions")),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"], ondelete="CASCADE",
                                name=op.f("fk_admin_sessions_api_key_id_api_keys")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE",
                                name=op.f("fk_admin_sessions_tenant_id_tenants")),
    )
    op.create_index(op.f("ix_admin_sessions_api_key_id"), "admin_sessions", ["api_key_id"])
    op.create_index(op.f("ix_admin_sessions_expires_at"), "admin_sessions", ["expires_at"])

    for table, column in _INDEXES:
        op.create_index(op.f(f"ix_{table}_{column}"), table, [column])
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("loss", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("loss")
    for table, column in _INDEXES:
        op.drop_index(op.f(f"ix_{table}_{column}"), table_name=table)
    op.drop_index(op.f("ix_admin_sessions_expires_at"), table_name="admin_sessions")
    op.drop_index(op.f("ix_admin_sessions_api_key_id"), table_name="admin_sessions")
    op.drop_table("admin_sessions")
    op.drop_index(op.f("ix_audit_log_tenant_id_id"), table_name="audit_log")
    op.drop_table("audit_log")
