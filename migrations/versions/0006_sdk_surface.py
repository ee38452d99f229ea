"""The whole tinker SDK surface: server-side custom losses, joined sampling clients, stability records.

- `custom_losses`: `create_custom_loss` graphs (checked data, never code), one per (session, seq).
- `sampling_sessions.joined_clients`: the counter `join_sampling_session` allocates clone ids from.
- `requests.record_stability`: a sample sent with `record_stability_info` (read by `stable_reinforce`).
- Index `requests (sampling_session_id, finished_at)`: `retrieve_futures` reads a session's completions
  in finishing order.

Projects need no table: a project id is a tenant's free-form label on `sessions.project_id` (0001).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = 128


def upgrade() -> None:
    op.create_table(
        "custom_losses",
        sa.Column("id", sa.String(length=ID), nullable=False),
        sa.Column("tenant_id", sa.String(length=ID), nullable=False),
        sa.Column("session_id", sa.String(length=ID), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("program", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_custom_losses")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_custom_losses_tenant_id_tenants")),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], name=op.f("fk_custom_losses_session_id_sessions")),
        sa.UniqueConstraint("session_id", "seq", name=op.f("uq_custom_losses_session_id_seq")),
    )
    op.create_index(op.f("ix_custom_losses_tenant_id"), "custom_losses", ["tenant_id"])
    with op.batch_alter_table("sampling_sessions") as batch:
        batch.add_column(sa.Column("joined_clients", sa.Integer(), server_default="0", nullable=False))
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("record_stability", sa.Boolean(), server_default=sa.false(), nullable=False))
    op.create_index(op.f("ix_requests_sampling_session_id_finished_at"), "requests",
                    ["sampling_session_id", "finished_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_requests_sampling_session_id_finished_at"), table_name="requests")
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("record_stability")
    with op.batch_alter_table("sampling_sessions") as batch:
        batch.drop_column("joined_clients")
    op.drop_index(op.f("ix_custom_losses_tenant_id"), table_name="custom_losses")
    op.drop_table("custom_losses")
