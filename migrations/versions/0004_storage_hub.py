"""Hub pushes as a product feature: push options and results on `hub_pushes`, and `hub_credentials`.

- `hub_pushes`: `revision` and `commit_message` (what the tenant asked for), `attempts` and `started_at`
  (the Celery task's progress), `hub_revision` and `url` (what the hub answered).
- `hub_credentials`: one encrypted token per tenant and hub (`hf`, `ms`); deleted with its tenant.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = 128
_PUSH_COLUMNS = (
    sa.Column("revision", sa.String(length=256), nullable=True),
    sa.Column("commit_message", sa.Text(), nullable=True),
    sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
    sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("hub_revision", sa.String(length=128), nullable=True),
    sa.Column("url", sa.String(length=512), nullable=True),
)


def upgrade() -> None:
    with op.batch_alter_table("hub_pushes") as batch:
        for column in _PUSH_COLUMNS:
            batch.add_column(column.copy())
    op.create_table(
        "hub_credentials",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=ID), nullable=False),
        sa.Column("target", sa.String(length=8), nullable=False),
        sa.Column("token_ciphertext", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("target IN ('hf', 'ms')", name=op.f("ck_hub_credentials_target_valid")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_hub_credentials_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hub_credentials")),
        sa.UniqueConstraint("tenant_id", "target", name=op.f("uq_hub_credentials_tenant_id_target")),
    )


def downgrade() -> None:
    op.drop_table("hub_credentials")
    with op.batch_alter_table("hub_pushes") as batch:
        for column in reversed(_PUSH_COLUMNS):
            batch.drop_column(column.name)
