"""Job profiles keep what the memory cycle says: mini-batch regularity and low-memory points.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "job_profiles", sa.Column("minibatch_cv", sa.Float(), nullable=False, server_default="0")
    )
    op.add_column(
        "job_profiles",
        sa.Column("low_memory_points", sa.Text(), nullable=False, server_default="[]"),
    )
    op.add_column(
        "job_profiles",
        sa.Column("low_memory_bytes", sa.BigInteger(), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    for column in ("low_memory_bytes", "low_memory_points", "minibatch_cv"):
        op.drop_column("job_profiles", column)
