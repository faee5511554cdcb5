"""Jobs: when each became ASSIGNED (`started_at`, 0 for rows written before).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("placement_jobs") as batch:
        batch.add_column(sa.Column("started_at", sa.Float(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("placement_jobs") as batch:
        batch.drop_column("started_at")
