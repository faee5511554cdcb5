"""Kernel statistics keep what spatial admission needs: the SMs a kernel's launch shape asks
for and its bound class. Rows from before read as unknown (0 SMs, "unknown").

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "kernel_stats", sa.Column("sm_usage", sa.Integer(), nullable=False, server_default="0")
    )
    op.add_column(
        "kernel_stats",
        sa.Column("bound", sa.String(length=16), nullable=False, server_default="unknown"),
    )


def downgrade() -> None:
    for column in ("bound", "sm_usage"):
        op.drop_column("kernel_stats", column)
