"""Widen `requests.seq_id` to 64 bits.

Sampling clients cloned by the SDK number their requests `clone_id * 10**9 + n`, which overflows a
32-bit column from the third clone on (a 500 on PostgreSQL). Training seq ids stay small either way.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.alter_column("seq_id", existing_type=sa.Integer(), type_=sa.BigInteger(), existing_nullable=True)


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.alter_column("seq_id", existing_type=sa.BigInteger(), type_=sa.Integer(), existing_nullable=True)
