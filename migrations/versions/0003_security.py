"""Security hardening (issue 16): per-tenant storage and session quotas, 64-bit `next_seq_id`.

- `tenants`: `max_checkpoints`, `max_checkpoint_bytes` (stored checkpoints), `max_sessions` (unfinished
  sessions) and `max_sampling_sessions`; NULL = the server-wide default applies.
- `training_runs.next_seq_id` becomes 64-bit: it stores the highest seq id + 1, which overflowed a 32-bit
  column for seq id 2**31 - 1 (a 500 on PostgreSQL).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

QUOTA_COLUMNS = (
    ("max_checkpoints", sa.Integer()),
    ("max_checkpoint_bytes", sa.BigInteger()),
    ("max_sessions", sa.Integer()),
    ("max_sampling_sessions", sa.Integer()),
)


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        for name, type_ in QUOTA_COLUMNS:
            batch.add_column(sa.Column(name, type_, nullable=True))
    with op.batch_alter_table("training_runs") as batch:
        batch.alter_column("next_seq_id", existing_type=sa.Integer(), type_=sa.BigInteger(),
                           existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("training_runs") as batch:
        batch.alter_column("next_seq_id", existing_type=sa.BigInteger(), type_=sa.Integer(),
                           existing_nullable=False)
    with op.batch_alter_table("tenants") as batch:
        for name, _ in reversed(QUOTA_COLUMNS):
            batch.drop_column(name)
