"""GPUs remember their node's CPU (milli) and memory for jobs, as their dispatcher registered
them (0: not reported).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("placement_gpus") as batch:
        batch.add_column(
            sa.Column("node_cpu_milli", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch.add_column(
            sa.Column("node_memory_bytes", sa.BigInteger(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("placement_gpus") as batch:
        batch.drop_column("node_memory_bytes")
        batch.drop_column("node_cpu_milli")
